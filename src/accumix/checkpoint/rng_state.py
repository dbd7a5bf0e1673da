"""Every RNG a resumed run must continue: python, numpy, torch, CUDA and each set-up loader's
generator, as tensors and numbers (a checkpoint's ``rank-N.pt``, read with ``weights_only``);
and the generators an object holds as its own (a dataset's), kept across a read that must not
move them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
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


_GENERATOR_TYPES = (np.random.Generator, np.random.RandomState, random.Random, torch.Generator)


def generators_in(obj: Any, depth: int = 4) -> list[Any]:
    """The random generators an object holds as its own (``self.rng = np.random.default_rng()``
    in a dataset or one of its transforms): numpy's ``Generator`` and ``RandomState``, python's
    ``random.Random``, ``torch.Generator``; found in attributes, and in the lists, tuples and
    dicts (up to 64 entries) they hold, ``depth`` levels down. Tensors, arrays and modules are
    not searched."""
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(value: Any, level: int) -> None:
        if isinstance(value, _GENERATOR_TYPES):
            if not isinstance(value, random.SystemRandom):  # the OS's entropy: no state
                found[id(value)] = value
            return
        if level > depth or id(value) in seen or isinstance(
                value, (torch.Tensor, np.ndarray, str, bytes, int, float, type, ModuleType)):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            children = list(value.values())
        elif isinstance(value, (list, tuple)):
            children = list(value)
        else:
            children = list(getattr(value, "__dict__", {}).values())
        if level and len(children) > 64:  # a dataset's samples, not its parts
            return
        for child in children:
            visit(child, level + 1)

    visit(obj, 0)
    return list(found.values())


@contextmanager
def generators_kept(obj: Any) -> Iterator[None]:
    """Puts every generator ``obj`` holds (``generators_in``) back as it was after the body:
    reading a dataset's samples to measure them must not move its own augmentation stream."""
    generators = generators_in(obj)
    states = [_state_of(gen) for gen in generators]
    try:
        yield
    finally:
        for gen, state in zip(generators, states, strict=True):
            if isinstance(gen, np.random.Generator):
                gen.bit_generator.state = state
            elif isinstance(gen, np.random.RandomState):
                gen.set_state(state)
            elif isinstance(gen, random.Random):
                gen.setstate(state)
            else:
                gen.set_state(state)


def _state_of(gen: Any) -> Any:
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    if isinstance(gen, np.random.RandomState):
        return gen.get_state()
    if isinstance(gen, random.Random):
        return gen.getstate()
    return gen.get_state()
