"""Publishing on an object store (``s3://``, ``gs://``, ...), where nothing can be renamed.

A save writes its objects straight into ``run_dir/step-N/``; its ``meta.json`` is written only
after every rank's objects are, and ``latest`` after it (each one object, written whole). A step
is published when its ``meta.json`` exists: ``latest`` never names a step without one, and the
listing of steps (``run_dir.step_dirs``) counts only steps that have one. So a reader sees the
previous checkpoint, or this one whole, whatever moment a save stops at; what a stopped save
left is removed by the next one (``prepare``).

Deleting a step (``keep_last``) removes its ``meta.json`` first: a reader listing the steps
meanwhile never takes the rest of the objects for a checkpoint.
"""

from __future__ import annotations

from accumix.common import run_dir as layout
from accumix.common.locations import RemotePath


def prepare(run_dir: RemotePath, final: RemotePath) -> None:
    """Makes ``final`` ready to be written in place: removes the objects of saves that stopped
    before their ``meta.json``; a step saved again first stops being published (``latest``
    goes back to the newest other step, or away when there is none)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    published = layout.step_dirs(run_dir)
    if final.name in published:
        pointer = run_dir / layout.LATEST
        if pointer.is_file() and pointer.read_text().strip() == final.name:
            others = [n for n in published if n != final.name]
            if others:
                layout.write_text(pointer, others[-1] + "\n")
            else:
                pointer.unlink(missing_ok=True)
        (final / layout.META).unlink(missing_ok=True)
    for entry in run_dir.iterdir():
        if layout.STEP_DIR.match(entry.name) and entry.name not in published:
            entry.rmtree()  # a save that stopped before its meta.json
    final.rmtree()


def remove_step(step_dir: RemotePath) -> None:
    """Deletes a published step: its ``meta.json`` first, so it is never half there."""
    (step_dir / layout.META).unlink(missing_ok=True)
    step_dir.rmtree()
