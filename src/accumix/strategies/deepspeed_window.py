"""Where each DeepSpeed engine is in its window, and the loops it cannot take (DeepSpeed 0.19).

The engine steps once per window, takes one backward on the window's last micro-step (that
backward reduces and *copies* into the partitions its step reads) and clears its gradients only
inside its step. ``DeepSpeedStrategy`` records each engine's backward and step here, by the
engine's id, and a loop that breaks one of these rules gets an error naming what to do instead
of DeepSpeed's own failure (or silently lost gradients).
"""

from __future__ import annotations

from typing import Any, NoReturn

from accumix.errors import AccumixError, ConfigError


class EngineWindows:
    """The engines' window state: which stepped, which hold a backward, which reduced."""

    def __init__(self) -> None:
        self.stepped: set[int] = set()  # ids of engines stepped since their last backward
        self.unstepped: set[int] = set()  # ids of engines with a backward since their step
        self.reduced: set[int] = set()  # ids of engines with a boundary backward since their step

    def check_backward(self, engine: Any, at_boundary: bool) -> None:
        """Refuses a second backward on a boundary micro-step."""
        if at_boundary and id(engine) in self.reduced:
            # Each boundary backward reduces and *copies* into the partitions the step reads
            # (ZeRO 1/2/3, 0.19.8): an earlier backward's gradients of this micro-step are lost.
            raise ConfigError(
                "strategy='deepspeed' takes one backward on a window's last micro-step, then "
                "optimizer.step() (a second one there replaces the first's gradients in the "
                "engine); sum the losses into one acc.backward(), num_items= their total")

    def backward_done(self, engine: Any, at_boundary: bool) -> None:
        self.stepped.discard(id(engine))
        self.unstepped.add(id(engine))
        if at_boundary:
            self.reduced.add(id(engine))

    def check_step(self, engine: Any) -> None:
        """Refuses a second step at one boundary."""
        if id(engine) in self.stepped:
            # The engine's step consumed and cleared its gradient partitions; a second one
            # fails inside DeepSpeed ("'NoneType' object is not iterable").
            raise AccumixError(
                "strategy='deepspeed' steps once per window: optimizer.step() was called again "
                "at the same boundary without a backward in between; call it once per window"
            )

    def step_done(self, engine: Any) -> None:
        self.stepped.add(id(engine))
        self.unstepped.discard(id(engine))
        self.reduced.discard(id(engine))

    def check_discard(self, engine: Any | None) -> None:
        """Refuses to discard a window's gradients without a step (``zero_grad``)."""
        if engine is not None and id(engine) in self.unstepped:
            raise ConfigError(
                "strategy='deepspeed' clears gradients only inside optimizer.step(), and "
                "zero_grad() was asked to discard a window that was not stepped; call "
                "optimizer.step() on every window's boundary (under fp16 the engine skips an "
                "overflowing one itself)"
            )


def refuse_deferred_reduction() -> NoReturn:
    """A window whose last backward ran before its last micro-step cannot be stepped."""
    # The engine reduces (and fills the partitions its step reads) only in a backward at
    # its accumulation boundary; stepping without one fails inside DeepSpeed (KeyError 0).
    raise ConfigError(
        "strategy='deepspeed' reduces gradients only in a backward on the window's last "
        "micro-step, and this window's last backward ran on an earlier one; run a backward "
        "on the last micro-step of every window (a zero loss works)"
    )
