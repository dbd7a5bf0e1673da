"""JAX checkpoints through orbax, in the torch side's run-directory layout
(``accumix.common.run_dir``)::

    run_dir/latest, run_dir/step-N/
      state/             the TrainState through orbax (sharded; restores onto any mesh)
      process-0.json     each process's host RNGs (python, numpy, torch if loaded)
      meta.json          written last: backend, step, strategy, precision, K, devices,
                         processes, the loader's epoch and position, and every file's size

``checkpoint_save.py`` writes it (a shared disk or an object store; in the loop or behind
it). Loading validates ``meta.json`` and the sizes first (a torn checkpoint is refused naming
the file, before anything changes), then restores into the placement of the state it is given:
the same mesh is bitwise, another device or process count is resharded by orbax. From an object
store, process 0 first downloads the state into a staging directory every process sees.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from accumix.common import run_dir as layout
from accumix.common.locations import RemotePath, location
from accumix.common.safe_write import replace_with
from accumix.errors import CheckpointError
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator

FORMAT = 1
STATE_DIR = "state"


def sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def all_gather_object(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order; a few bytes here."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    # The peers are this job's own processes (as torch's all_gather_object unpickles them).
    return [pickle.loads(everyone[i, :int(n)].tobytes())  # noqa: S301
            for i, n in enumerate(sizes.reshape(-1))]


def load(acc: Accelerator, path: Any, state: TrainState) -> TrainState:
    """The state at ``path`` (a local path or an object store URL) placed like ``state``;
    restores host RNGs and the loader too."""
    from accumix.jax import checkpoint_save

    checkpoint_save.finish(acc, "acc.load_state")
    where = location(path)
    step_dir = layout.resolve(where if isinstance(where, RemotePath) else where.absolute())
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
    staging = None
    source = step_dir / STATE_DIR
    if isinstance(step_dir, RemotePath):  # orbax reads a local copy (checkpoint_save.py)
        staging = checkpoint_save.staging_dir(acc, "load_state")
        if acc.is_main_process:
            checkpoint_save.download(step_dir / STATE_DIR, staging / STATE_DIR)
        sync(f"accumix-load-downloaded-{meta['step']}")
        source = staging / STATE_DIR
    reader = checkpointer()
    try:
        restored = reader.restore(source, target)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{step_dir / STATE_DIR} does not fit this run's state (another model or "
            f"optimizer?): {str(exc).splitlines()[0]}") from exc
    finally:
        reader.close()
        if staging is not None:
            sync(f"accumix-load-restored-{meta['step']}")
            if acc.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
    host = step_dir / f"process-{jax.process_index()}.json"
    if host.is_file() and meta["num_processes"] == jax.process_count():
        _sethost_rng_state(json.loads(host.read_text()))
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
    sync("accumix-save-model")
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


def host_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if "torch" in sys.modules:
        state["torch"] = sys.modules["torch"].get_rng_state().tolist()
    return state


def _sethost_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))
    if "torch" in state and "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
