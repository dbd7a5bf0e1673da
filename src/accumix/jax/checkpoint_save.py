"""``acc.save_state`` on JAX: orbax writes the state, accumix publishes the step directory.

    run_dir/latest, run_dir/step-N/ (state/, process-<i>.json, meta.json): checkpoint.py

* A local ``run_dir`` must be one filesystem every process sees (orbax's multi-process save has
  the primary process finish what every process wrote): a run directory per process is refused
  in one line (``common/shared_dir.py`` finds out, at every save).
* An object store URL: this orbax writes ``gs://`` itself but not ``s3://`` or ``az://``, so
  every store goes the same way: orbax writes into a local staging directory
  (``$ACCUMIX_STAGING_DIR``, default the system's temporary directory; with several processes
  it must be one they share, checked the same way), then process 0 uploads its files into
  ``step-N/``, writes ``meta.json``, then ``latest`` (``common/remote_publish.py``), and
  removes the staging copy. It costs one checkpoint of local disk and the upload's time.
* ``background=True``: orbax's asynchronous save returns once the state is on the host; a
  thread waits for orbax's commit, then publishes (or uploads and publishes). At most one save is
  in flight; the next save, ``load_state``, ``wait_for_save`` and ``end`` wait for it and raise
  its error on every process.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from accumix.checkpoint.background import PendingSave
from accumix.common import run_dir as layout
from accumix.common import shared_dir
from accumix.common.locations import AnyPath, RemotePath, location
from accumix.errors import CheckpointError, ConfigError
from accumix.jax import checkpoint as ckpt
from accumix.jax.state import TrainState

if TYPE_CHECKING:
    from accumix.jax.accelerator import Accelerator

log = logging.getLogger("accumix")
STAGING_ENV = "ACCUMIX_STAGING_DIR"


def save(acc: Accelerator, run_dir: Any, state: TrainState, *, keep_last: int | None,
         extra_state: dict[str, Any] | None = None,
         before_publish: Callable[[Any], None] | None = None,
         background: bool = False) -> AnyPath:
    """Writes ``run_dir/step-<state.step>`` atomically, then ``latest``. Collective.
    ``before_publish(tmp)`` (every process) writes more files into the temporary step directory
    (local: on an object store, the staging copy), published with it."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise ConfigError(f"keep_last={keep_last!r} is invalid; use an integer >= 1 or None")
    if extra_state is not None:
        extra_state = layout.json_state(extra_state, "save_state(extra_state=...)")
    where = location(run_dir)
    finish(acc, "acc.save_state")
    step = int(jax.device_get(state.step))
    primary = acc.is_main_process
    if isinstance(where, RemotePath):
        final: AnyPath = where / f"step-{step}"
        staging = staging_dir(acc, "save_state")
        tmp = staging / f".step-{step}.tmp"
        if primary:
            layout.prepare(where, final)  # removes what stopped saves left in the store
            tmp.mkdir()
    else:
        where = where.absolute()
        _require_shared(where)
        final, tmp, staging = where / f"step-{step}", where / f".step-{step}.tmp", None
        if primary:
            layout.prepare(where, tmp)
    ckpt.sync(f"accumix-save-prepare-{step}")
    layout.write_json(tmp / f"process-{jax.process_index()}.json", ckpt.host_rng_state())
    if before_publish is not None:
        before_publish(tmp)
    meta = _meta(acc, step, extra_state) if primary else {}
    checkpointer = ckpt.checkpointer()
    checkpointer.save(tmp / ckpt.STATE_DIR, state)  # returns once the state is on the host

    def write_and_publish() -> None:
        try:
            checkpointer.wait_until_finished()
        finally:
            checkpointer.close()
        if not background:
            ckpt.sync(f"accumix-save-written-{step}")
        if not primary:
            return
        if isinstance(where, RemotePath):
            assert isinstance(final, RemotePath) and staging is not None
            upload(tmp, final)
            layout.publish(where, final, final, meta, keep_last)
            shutil.rmtree(staging, ignore_errors=True)
        else:
            layout.publish(where, tmp, final, meta, keep_last)

    if background:
        acc._pending_save = pending = PendingSave(step_dir=final)
        pending.run(write_and_publish)
        return final
    write_and_publish()
    ckpt.sync(f"accumix-save-published-{step}")
    return final


def _meta(acc: Accelerator, step: int, extra_state: dict[str, Any] | None) -> dict[str, Any]:
    loader = acc.loader
    meta: dict[str, Any] = {
        "format": ckpt.FORMAT,
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
    return meta


def finish(acc: Accelerator, why: str) -> Any:
    """Waits for the background save in flight, if any (collective); its step directory, or
    None.

    Raises:
        CheckpointError: it failed on some process (every process raises it).
    """
    pending: PendingSave | None = getattr(acc, "_pending_save", None)
    if pending is None:
        return None
    acc._pending_save = None
    assert pending.thread is not None
    if pending.thread.is_alive() and acc.is_main_process:
        log.info("%s waits for the background save of %s (at most one in flight)", why,
                 pending.step_dir)
    pending.thread.join()
    errors = ckpt.all_gather_object(pending.error)
    failed = [(p, e) for p, e in enumerate(errors) if e is not None]
    if failed:
        process, message = failed[0]
        raise CheckpointError(f"the background save of {pending.step_dir} failed on process "
                              f"{process}: {message}; the previous checkpoint is still the "
                              "latest")
    return pending.step_dir


def _require_shared(run_dir: Path) -> None:
    nodes = shared_dir.probe(run_dir, rank=jax.process_index(), world_size=jax.process_count(),
                             all_gather=ckpt.all_gather_object)
    if not nodes.shared:
        raise CheckpointError(
            f"the JAX processes see different directories at {run_dir} (processes "
            f"{[list(g) for g in nodes.groups]} each share one): orbax, which writes "
            "accumix.jax checkpoints, needs a filesystem every process sees; give a shared "
            "run_dir or an object store URL (s3://...)")


def staging_dir(acc: Accelerator, what: str) -> Path:
    """A fresh local directory, the same one on every process, that every process sees
    (collective); the caller removes it.

    Raises:
        CheckpointError: the processes do not share it (``$ACCUMIX_STAGING_DIR`` names where).
    """
    base = Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())
    name = ckpt.all_gather_object(f"accumix-staging-{uuid.uuid4().hex[:16]}"
                                  if acc.is_main_process else None)[0]
    staging = base / name
    staging.mkdir(parents=True, exist_ok=True)
    nodes = shared_dir.probe(staging, rank=jax.process_index(),
                             world_size=jax.process_count(), all_gather=ckpt.all_gather_object)
    if not nodes.shared:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"{what} to an object store goes through a local staging directory that every JAX "
            f"process sees (orbax writes the shards there); {base} is not one (processes "
            f"{[list(g) for g in nodes.groups]} each share one): set {STAGING_ENV} to a "
            "directory on a filesystem they share")
    return staging


def upload(local: Path, remote: RemotePath) -> None:
    """Every file under ``local`` into ``remote``, by relative name (one batched put)."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    targets = [(remote / p.relative_to(local).as_posix()).path for p in files]
    if files:
        remote.fs.put([str(p) for p in files], targets)


def download(remote: RemotePath, local: Path) -> None:
    """Every object below ``remote`` into ``local``, by relative name."""
    names = sorted(remote.sizes())
    for name in names:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
    if names:
        remote.fs.get([(remote / n).path for n in names], [str(local / n) for n in names])
