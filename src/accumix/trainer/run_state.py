"""The Trainer's own state in a checkpoint: whether a callback stopped the run, the last losses,
and every callback's ``state_dict()``, as JSON in the step's ``meta.json`` (``save_state(...,
extra_state=)``). A finished run that is run again loads it and does nothing more.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from accumix.common import run_dir as layout

if TYPE_CHECKING:
    from accumix.trainer.events import Callback
    from accumix.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def state_of(trainer: Trainer) -> dict[str, Any]:
    """``trainer``'s state and its callbacks' (those with any), JSON.

    Raises:
        ConfigError: a callback's state is not JSON (named).
    """
    callbacks = {}
    for key, callback in _keyed(trainer.callbacks):
        state = callback.state_dict() if hasattr(callback, "state_dict") else {}
        state = layout.json_state(state, f"callback {key}'s state_dict()")
        if state:
            callbacks[key] = state
    last = trainer.last_metrics
    loss = last.loss if last is not None else trainer._saved_result.get("loss", math.nan)
    return {"trainer": {"should_stop": trainer.should_stop, "loss": loss, "epoch": trainer.epoch,
                        "val": trainer.last_val, "evaluated_step": trainer._evaluated_step,
                        "stopped_by": trainer._stopped_by},
            "callbacks": callbacks, "classes": [type(c).__name__ for c in trainer.callbacks]}


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    """Puts ``state_of``'s result back; a callback the checkpoint has no state for keeps its
    own. Callbacks of a class the run now has a different number of than the checkpoint did,
    with more than one on either side, keep their own state (a warning names the class): the
    order that tells them apart no longer does, and the first one left would load the state of
    the one removed."""
    own = state.get("trainer")
    if own:
        trainer.should_stop = bool(own["should_stop"])
        trainer._saved_result = {"loss": own["loss"], "epoch": own["epoch"]}
        trainer.last_val = dict(own["val"])
        trainer._evaluated_step = own["evaluated_step"]
    saved = state.get("callbacks", {})
    then = Counter(state.get("classes", ()))
    now = Counter(type(c).__name__ for c in trainer.callbacks)
    ambiguous = {name for name in now if "classes" in state and then[name] != now[name]
                 and max(then[name], now[name]) > 1}
    for name in sorted(ambiguous):
        log.warning("accumix: the checkpoint had %d %s callback(s), this run has %d: their saved "
                    "state is not loaded (which one was which is unknown); they start afresh",
                    then[name], name, now[name])
    for key, callback in _keyed(trainer.callbacks):
        if type(callback).__name__ in ambiguous:
            continue
        if key in saved and hasattr(callback, "load_state_dict"):
            callback.load_state_dict(saved[key])
    # A stop a callback made is kept only while that callback, with this run's settings and its
    # resumed state, still stops it: an EarlyStopping given more patience continues the run.
    stopper = dict(_keyed(trainer.callbacks)).get(own.get("stopped_by")) if own else None
    if trainer.should_stop and hasattr(stopper, "still_stops") and not stopper.still_stops():
        trainer.should_stop = False
    elif own:
        trainer._stopped_by = own.get("stopped_by")


def key_of(callbacks: list[Callback], callback: Callback) -> str:
    """``callback``'s key among ``callbacks`` (see ``_keyed``)."""
    return next(key for key, c in _keyed(callbacks) if c is callback)


def _keyed(callbacks: list[Callback]) -> list[tuple[str, Callback]]:
    """Each callback with a key that finds it again in a resumed run: its class name, and
    ``#2``, ``#3`` ... for the second and later of one class."""
    seen: dict[str, int] = {}
    keys = []
    for callback in callbacks:
        name = type(callback).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append((name if seen[name] == 1 else f"{name}#{seen[name]}", callback))
    return keys
