"""What gradients travel in: the ``reduce_dtype`` words, the fp16 rule, and the effective dtypes.

Backend-free and torch-free (the JAX backend parses the same words and states its dtypes the same
way): a dtype is named by its canonical string (``"float32"``, ``"bfloat16"``, ``"float16"``);
each backend maps the name to its own dtype object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from accumix.errors import ConfigError

REDUCE_DTYPE_WORDS = ("fp32", "bf16", "fp16")
_CANONICAL = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
              "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_reduce_dtype(value: Any) -> str | None:
    """The canonical dtype name of a ``reduce_dtype`` setting.

    Args:
        value: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or ``"float32"``, ...), a framework dtype
            (``torch.bfloat16``, ``jnp.bfloat16``, a numpy dtype), or None.

    Returns:
        ``"float32"``, ``"bfloat16"`` or ``"float16"``; None for None (the precision's own).

    Raises:
        ConfigError: any other value.
    """
    if value is None:
        return None
    name = value if isinstance(value, str) else (
        getattr(value, "name", None) or getattr(value, "__name__", None) or str(value))
    name = str(name).removeprefix("torch.")
    if name in _CANONICAL:
        return _CANONICAL[name]
    raise ConfigError(f"reduce_dtype={value!r} is invalid; use one of "
                      f"{', '.join(repr(w) for w in REDUCE_DTYPE_WORDS)} or None (the precision's)")


def check_fp16_reduction(reduce_dtype: str, *, loss_scaled: bool, precision: str) -> None:
    """Refuses an fp16 reduction where no loss scaling runs.

    Under ``fp16-mixed`` an overflow on the wire (inf/NaN after the reduction) is found by the
    boundary's check and skips the step on every rank, and the loss scale backs off; without a
    loss scale nothing would ever bring the gradients back into fp16's range.

    Raises:
        ConfigError: ``reduce_dtype`` is fp16 and the precision scales no loss.
    """
    if reduce_dtype == "float16" and not loss_scaled:
        raise ConfigError(
            f"reduce_dtype='fp16' needs loss scaling to recover from an overflow, which "
            f"precision={precision!r} does not run; use reduce_dtype='bf16' (same bytes, "
            "float32's range) or precision='fp16-mixed'")


@dataclass(kw_only=True, frozen=True, slots=True)
class EffectiveDtypes:
    """The dtypes a run really uses, as one strategy of one backend applies the policy.

    Attributes:
        params: the stored parameters.
        compute: the forward's and backward's matmuls.
        accumulation: where a window's gradients are summed between its micro-steps.
        reduction: what gradients travel in between ranks; ``"none"`` on one process.
        masters: what the optimizer updates (the master weights).
        reductions: how often gradients are reduced: ``"once per optimizer step"``, or
            ``"every micro-step"`` with the reason (then a 16-bit reduction rounds K times).
    """

    params: str
    compute: str
    accumulation: str
    reduction: str
    masters: str
    reductions: str = "once per optimizer step"

    def describe(self) -> str:
        """One line for the startup log."""
        wire = self.reduction if self.reduction == "none" else (
            f"{self.reduction} ({self.reductions})")
        return (f"effective dtypes: params {self.params}, compute {self.compute}, gradient "
                f"accumulation {self.accumulation}, reduction {wire}, optimizer masters "
                f"{self.masters}")

    def as_params(self) -> dict[str, str]:
        """The trackers' parameters: ``dtype_params``, ``dtype_compute``, ..."""
        return {f"dtype_{key}": value for key, value in asdict(self).items()}


def reduction_bytes(num_grads: int, reduce_dtype: str, *, reductions_per_step: int = 1) -> int:
    """The gradient payload one rank hands to its collectives per optimizer step: every
    trainable element once per reduction (what a ring all-reduce or a reduce-scatter reduces;
    the wire carries about 2(W-1)/W of it for an all-reduce, (W-1)/W for a reduce-scatter)."""
    return num_grads * ITEMSIZE[reduce_dtype] * reductions_per_step
