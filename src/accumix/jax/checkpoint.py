"""JAX checkpoints through orbax, in the torch side's run-directory layout
(``accumix.common.run_dir``)::

    run_dir/latest, run_dir/step-N/
      state/             the TrainState through orbax (sharded; restores onto any mesh)
      process-0.json     each process's host RNGs (python, numpy, torch if loaded)
      meta.json          written last: backend, step, strategy, precision, K, devices,
                         processes, the loader's epoch and position, and every file's size

Loading validates ``meta.json`` and the sizes first (a torn checkpoint is refused naming the
file, before anything changes), then restores into the placement of the state it is given:
the same mesh is bitwise, another device or process count is resharded by orbax.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from accumix.common import run_dir as layout
from accumix.common.safe_write import replace_with
from accumix.errors import CheckpointError, ConfigError
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator

FORMAT = 1
STATE_DIR = "state"


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save(acc: Accelerator, run_dir: Path, state: TrainState, *, keep_last: int | None,
         extra_state: dict[str, Any] | None = None,
         before_publish: Callable[[Path], None] | None = None) -> Path:
    """Writes ``run_dir/step-<state.step>`` atomically, then ``latest``. Collective.
    ``before_publish(tmp)`` (every process) writes more files into the temporary step directory,
    published with it."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r} is invalid; use an integer >= 1 or None")
    if extra_state is not None:
        extra_state = layout.json_state(extra_state, "save_state(extra_state=...)")
    run_dir = run_dir.absolute()
    step = int(jax.device_get(state.step))
    final, tmp = run_dir / f"step-{step}", run_dir / f".step-{step}.tmp"
    if acc.is_main_process:
        layout.prepare(run_dir, tmp)
    _sync(f"accumix-save-prepare-{step}")
    checkpointer = _checkpointer()
    checkpointer.save(tmp / STATE_DIR, state)
    checkpointer.wait_until_finished()
    checkpointer.close()
    layout.write_json(tmp / f"process-{jax.process_index()}.json", _host_rng_state())
    if before_publish is not None:
        before_publish(tmp)
    _sync(f"accumix-save-written-{step}")
    if acc.is_main_process:
        loader = acc.loader
        meta = {
            "format": FORMAT,
            "backend": "jax",
            "step": step,
            "strategy": acc.strategy.name,
            "precision": acc.policy.name,
            "grad_accum_steps": acc.grad_accum_steps,
            "num_devices": acc.num_devices,
            "num_processes": jax.process_count(),
            "loader": loader.state_dict() if loader is not None else None,
        }
        if extra_state is not None:
            meta["extra_state"] = extra_state
        layout.publish(run_dir, tmp, final, meta, keep_last)
    _sync(f"accumix-save-published-{step}")
    return final


def load(acc: Accelerator, path: Path, state: TrainState) -> TrainState:
    """The state at ``path`` placed like ``state``; restores host RNGs and the loader too."""
    step_dir = layout.resolve(path.absolute())
    meta = layout.read_meta(step_dir)
    if meta.get("backend") != "jax" or "files" not in meta:
        raise CheckpointError(
            f"{step_dir / layout.META} is not an accumix.jax checkpoint (backend "
            f"{meta.get('backend', 'torch')!r}); load it with the backend that wrote it")
    layout.check_manifest(step_dir, meta["files"])
    if meta["precision"] != acc.policy.name:
        raise CheckpointError(
            f"{step_dir} was saved with precision {meta['precision']!r}, this run has "
            f"{acc.policy.name!r}; use the same precision to resume")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    checkpointer = _checkpointer()
    try:
        restored = checkpointer.restore(step_dir / STATE_DIR, target)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{step_dir / STATE_DIR} does not fit this run's state (another model or "
            f"optimizer?): {str(exc).splitlines()[0]}") from exc
    finally:
        checkpointer.close()
    host = step_dir / f"process-{jax.process_index()}.json"
    if host.is_file() and meta["num_processes"] == jax.process_count():
        _set_host_rng_state(json.loads(host.read_text()))
    if acc.loader is not None and meta.get("loader") is not None:
        acc.loader.load_state_dict(meta["loader"])
    return restored


def save_model(acc: Accelerator, directory: Path, state: TrainState) -> Path:
    """``directory/model.safetensors``: the params, keys joined with dots.

    Real floating leaves in float32, complex ones in complex64, integer leaves in their own
    dtype; PRNG keys (state, not weights) are left out.
    """
    from safetensors.numpy import save_file

    tensors = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue
        full = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        tensors[_dotted(key_path)] = np.ascontiguousarray(full.astype(_file_dtype(full.dtype)))
    path = directory / "model.safetensors"
    if acc.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        replace_with(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "np"}))
    _sync("accumix-save-model")
    return path


def _file_dtype(dtype: np.dtype) -> Any:
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
        return np.complex64
    return np.float32 if jax.numpy.issubdtype(dtype, jax.numpy.floating) else dtype


def _dotted(key_path: tuple[Any, ...]) -> str:
    """``a.b.c``; a flax nnx ``Variable``'s trailing ``.value`` is dropped (flax's own flat key
    is ``l1.kernel``, not ``l1.kernel.value``)."""
    if key_path and isinstance(key_path[-1], jax.tree_util.GetAttrKey) and (
            key_path[-1].name == "value"):
        key_path = key_path[:-1]
    parts = []
    for key in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _host_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if "torch" in sys.modules:
        state["torch"] = sys.modules["torch"].get_rng_state().tolist()
    return state


def _set_host_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))
    if "torch" in state and "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
