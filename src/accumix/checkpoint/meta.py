"""A checkpoint's ``meta.json``: what ``save_state`` records (versions, world, strategy,
precision, K's geometry, the training state) and the checks ``load_state`` makes on it before it
changes anything (format, every file's size, retired formats, the set-up objects' counts and the
schedulers' types)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accumix.common.run_dir import META, alternatives
from accumix.common.safe_paths import inside
from accumix.errors import CheckpointError
from accumix.step import accum_steps, window_end

if TYPE_CHECKING:
    from accumix.step.run_state import RunState

FORMAT = 1
# Formats this accumix no longer reads: what wrote them and what still loads them.
_RETIRED_FORMATS = {
    "deepspeed": "{path} holds DeepSpeed's own engine checkpoint (checkpoint_format='deepspeed', "
                 "written by strategy='deepspeed' in accumix {version}), which this accumix no "
                 "longer reads: strategy='deepspeed' now saves the format every strategy shares; "
                 "resume it with accumix {version} on {world} ranks, or rebuild its weights with "
                 "DeepSpeed's zero_to_fp32.py on {path}/model",
}
_STATE_KEYS = ("optimizer_steps", "step_was_skipped", "window", "scaler", "models",
               "optimizers", "schedulers", "loaders")


def metadata(run: RunState, empty: list[bool]) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint ``save_state`` writes (``empty``: which optimizers
    had no state before the save)."""
    from accumix import __version__

    loaders = [{**loader.state_dict(), **loader.sampling_state()} for loader in run.loaders]
    return {
        "format": FORMAT,
        "accumix_version": __version__,
        "torch_version": torch.__version__,
        "step": run.optimizer_steps,
        "epoch": loaders[0]["epoch"] if loaders else None,
        "position": loaders[0]["position"] if loaders else None,
        "world_size": run.world_size,
        "strategy": run.strategy.name,
        "checkpoint_format": run.strategy.checkpoint_format,
        "precision": run.policy.name,
        "grad_accum_steps": run.grad_accum_steps,
        "grad_accum": accum_steps.geometry(run),
        "state": {
            "optimizer_steps": run.optimizer_steps,
            "step_was_skipped": run.step_was_skipped,
            "window": run.window.state_dict(),
            "scaler": run.strategy.scaler.state_dict(),
            # The last window's overflow when its scale update still waits for a step or a
            # zero_grad (the save came between them): the resumed run makes that update.
            "pending_scale_update": window_end.pending_overflow(run),
            "models": len(run.models),
            "optimizers": [{"stepped_window": o.stepped_window, "empty": e}
                           for o, e in zip(run.optimizers, empty, strict=True)],
            # The state itself is in schedulers.pt; these are for a reader (and the type check).
            "schedulers": [{"type": type(s.scheduler).__name__,
                            "last_epoch": getattr(s.scheduler, "last_epoch", None),
                            "stepped_window": s._stepped_window} for s in run.schedulers],
            "loaders": loaders,
        },
    }


def validate(run: RunState, step_dir: Path) -> dict[str, Any]:
    """``step_dir``'s ``meta.json``, checked against the files beside it and ``acc``'s set-up
    objects; raises ``CheckpointError`` naming the first mismatch."""
    meta_path = step_dir / META
    try:
        meta = json.loads(meta_path.read_text())
        state = meta["state"]
        missing = [k for k in ("format", "world_size", "files") if k not in meta] + [
            f"state.{k}" for k in _STATE_KEYS if k not in state]
        files = dict(meta["files"]) if "files" in meta else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{meta_path} is unreadable or incomplete "
                              f"({type(exc).__name__}: {exc}); {alternatives(step_dir)}") from exc
    if missing:
        raise CheckpointError(
            f"{meta_path} is not the meta.json of an accumix checkpoint (it has no "
            f"{', '.join(map(repr, missing))}); pass a directory written by acc.save_state"
        )
    for name, size in files.items():
        file = inside(step_dir, name, f"{META}'s file list")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; {alternatives(step_dir)}")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{file} has {file.stat().st_size} bytes where {size} were written (truncated "
                f"or overwritten); {alternatives(step_dir)}"
            )
    if meta.get("checkpoint_format") in _RETIRED_FORMATS:
        raise CheckpointError(_RETIRED_FORMATS[meta["checkpoint_format"]].format(
            path=step_dir, version=meta.get("accumix_version"), world=meta["world_size"]))
    expected = {
        "format": FORMAT,
        "checkpoint_format": run.strategy.checkpoint_format,
        "precision": run.policy.name,
    }
    for key, mine in expected.items():
        if meta.get(key) != mine:
            raise CheckpointError(
                f"{meta_path} has {key}={meta.get(key)!r} but this run has {mine!r} "
                f"(strategy {run.strategy.name!r}); resume with the settings it was saved with"
            )
    counts = {
        "models": (state["models"], len(run.models)),
        "optimizers": (len(state["optimizers"]), len(run.optimizers)),
        "LR schedulers": (len(state["schedulers"]), len(run.schedulers)),
        "DataLoaders": (len(state["loaders"]), len(run.loaders)),
    }
    for what, (saved, mine) in counts.items():
        if saved != mine:
            raise CheckpointError(
                f"{meta_path} holds {saved} {what} but this run set up {mine}; "
                "call acc.setup with the same objects before acc.load_state"
            )
    for index, (saved, sched) in enumerate(zip(state["schedulers"], run.schedulers,
                                               strict=True)):
        mine = type(sched.scheduler).__name__
        if saved.get("type", mine) != mine:
            raise CheckpointError(
                f"{meta_path} holds a {saved['type']} as LR scheduler {index} but this run set "
                f"up a {mine}; set up the scheduler the checkpoint was saved with"
            )
    rank_file = step_dir / f"rank-{run.rank % meta['world_size']}.pt"
    if not rank_file.is_file():
        here = meta.get("ranks_here")
        raise CheckpointError(
            f"{rank_file} is missing" + ("" if here is None else (
                f": this node's run directory holds the files of ranks {here} of the "
                f"{meta['world_size']} that saved it (a run directory per node); resume on "
                "the ranks and nodes it was saved on, or copy every node's files of this "
                "step into one directory")))
    return meta
