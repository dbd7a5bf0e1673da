"""What ``acc.train_step`` and ``acc.eval_step`` return: the jitted functions (``step.py``)
with what the host does around them (make a window, check the fp16 floor, place eval rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from accumix.errors import ConfigError
from accumix.jax.data import Window, canonical
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator


class TrainStep:
    """The jitted step, plus the every-N-steps fp16 floor check (the step never syncs)."""

    def __init__(self, jitted: Any, acc: Accelerator, check_every: int) -> None:
        self.jitted, self._acc, self._check_every, self._calls = jitted, acc, check_every, 0

    def __call__(self, state: TrainState, window: Window | list[Any]
                 ) -> tuple[TrainState, dict[str, jax.Array]]:
        if not isinstance(window, Window):
            window = self._acc.window(window)
        state, metrics = self.jitted(state, window)
        self._calls += 1
        if self._acc.scaler.enabled and self._calls % self._check_every == 0:
            self._acc.check(state)
        return state, metrics

    def lower(self, state: TrainState, window: Window) -> Any:
        """``jax.jit(...).lower`` of the step (for HLO inspection)."""
        return self.jitted.lower(state, window)


class EvalStep:
    """``acc.eval_step``'s callable: this process's rows in, the global sums out."""

    def __init__(self, jitted: Any, acc: Accelerator) -> None:
        self.jitted, self._acc = jitted, acc

    def __call__(self, state: TrainState, batch: Any, weight: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
        strategy = self._acc.strategy
        rows = strategy.sharding(strategy.rows_spec())
        local = jax.tree.map(canonical, batch)
        first = jax.tree.leaves(local)[0]
        if first.shape[0] % self._acc.local_devices:
            raise ConfigError(f"an evaluation batch of {first.shape[0]} rows cannot be split "
                              f"over this process's {self._acc.local_devices} devices")
        arrays = jax.tree.map(lambda a: jax.make_array_from_process_local_data(rows, a), local)
        weights = jax.make_array_from_process_local_data(
            rows, np.full(first.shape[0], weight, np.float32))
        return self.jitted(state, arrays, weights)
