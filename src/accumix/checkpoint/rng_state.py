"""Every RNG a resumed run must continue: python, numpy, torch, CUDA and each set-up loader's
generator, as tensors and numbers (a checkpoint's ``rank-N.pt``, read with ``weights_only``)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from accumix.step.run_state import RunState


def capture(run: RunState) -> dict[str, Any]:
    """This rank's RNG states."""
    version, mt_state, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "loaders": [loader.loader.generator.get_state()
                    if loader.loader.generator is not None else None
                    for loader in run.loaders],
    }
    return state


def restore(run: RunState, state: dict[str, Any]) -> None:
    """Sets what ``capture`` returned; last in a load (nothing may draw after it)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    for loader, gen_state in zip(run.loaders, state["loaders"], strict=False):
        if gen_state is not None and loader.loader.generator is not None:
            loader.loader.generator.set_state(gen_state)
