"""The façade's loss scaler under DeepSpeed fp16: the engine scales the loss and keeps the scale;
this proxy reads and writes it in ``DynamicLossScale``'s form."""

from __future__ import annotations

from typing import Any

from accumix.precision import DynamicLossScale, NoLossScale
from accumix.strategies import deepspeed_state


class EngineLossScale(NoLossScale):
    """The façade's scaler under DeepSpeed fp16: the engine scales the loss and keeps the scale.

    ``scale`` is 1.0, so the façade multiplies the loss by nothing and its boundary factor
    holds no unscaling; ``enabled`` keeps fp16's item hint (summed losses divided by the usual
    item count, so they stay in fp16's range). ``acc.loss_scale`` reads the engine's scale
    through ``Strategy.loss_scale``. ``state_dict`` / ``load_state_dict`` read and write the
    engine's ``DynamicLossScaler`` in ``DynamicLossScale``'s form (``deepspeed_state``), so the
    scale, its clean-step count and hysteresis budget carry across strategies; before an engine
    exists they are the configured scaler's.
    """

    enabled = True

    def __init__(self, configured: DynamicLossScale, engines: list[Any]) -> None:
        self._configured = configured
        self._engines = engines

    def _engine_scaler(self) -> Any:
        scaler = getattr(self._engines[0].optimizer, "loss_scaler", None) if (
            self._engines) else None
        return scaler if hasattr(scaler, "cur_hysteresis") else None

    def state_dict(self) -> dict[str, Any]:
        scaler = self._engine_scaler()
        if scaler is None:
            return self._configured.state_dict()
        return deepspeed_state.scaler_state(scaler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scaler = self._engine_scaler()
        if scaler is None:
            self._configured.load_state_dict(state)
        else:
            deepspeed_state.load_scaler_state(scaler, state)

