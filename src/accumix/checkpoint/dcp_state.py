"""Models and optimizers through ``torch.distributed.checkpoint``: the default strategy hooks.

``get_state_dict`` names every entry by the plain model's keys whatever the wrapper (DDP, FSDP2),
and FSDP2's DTensor shards are written as shards, so a checkpoint loads on another world size and
into another of these strategies. Loading never unpickles arbitrary objects: DCP's ``.metadata``
goes through a whitelist of the classes DCP writes there, and its non-tensor entries (optimizer
hyper-parameters) through ``torch.load(weights_only=True)`` instead of torch's
``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from accumix.checkpoint import load_limits, node_copies
from accumix.checkpoint.plain_values import numpy_floats, plain
from accumix.common.locations import STORAGE_OPTIONS, is_url
from accumix.common.safe_paths import inside
from accumix.errors import CheckpointError
from accumix.runtime import fault


def save_sharded(directory: str, models: list[nn.Module], optimizers: list[Optimizer]) -> None:
    """Saves models and optimizers with ``torch.distributed.checkpoint`` (collective).

    ``get_state_dict`` names every entry by the plain model's keys whatever the wrapper (DDP,
    FSDP2), and FSDP2's DTensor shards are written as shards: a load on another world size
    reshards them.
    """
    write(state_of(models, optimizers), directory)


def state_of(models: list[nn.Module], optimizers: list[Optimizer]) -> dict[str, Any]:
    """What ``save_sharded`` writes: ``model{i}`` and ``optim{i}`` by the plain models' keys
    (the live tensors, not copies)."""
    return _state(models, optimizers)


class StagedWrite:
    """A write ``stage`` started: ``finish()`` waits for it and, on run directories per node,
    gives every node its ``.metadata`` (collective over the save's group: call it from the
    caller's thread for it); ``abandon()`` only waits (a save that will not be published)."""

    def __init__(self, future: Any, finish: Callable[[], None]) -> None:
        self.future, self.finish = future, finish

    def abandon(self) -> None:
        self.future.exception()  # waits; its error does not matter any more


class StagingBuffers:
    """The host-memory copy of a run's state, reused from one background save to the next
    while the state keeps its structure: filling fresh memory pays a page fault per page on
    every save, which doubled the copy of 200 MB on the 2-core machine (0.71 s against 0.39 s,
    median of 7). Holds one copy of the state between saves."""

    def __init__(self) -> None:
        self._buffers: Any = None

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every tensor copied into these buffers (other values as they are)."""
        from torch.distributed._state_dict_utils import (
            CompanionMismatch,
            _copy_state_dict,
            _create_cpu_state_dict,
        )

        if self._buffers is not None:
            try:
                return _copy_state_dict(state, self._buffers)
            except (CompanionMismatch, RuntimeError):  # another structure, shape or dtype
                self._buffers = None
        self._buffers = _create_cpu_state_dict(state)
        return _copy_state_dict(state, self._buffers)


class _AlreadyStaged:
    """DCP's stager protocol for a state dict this module has copied already."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def stage(state: dict[str, Any], directory: str, *, nodes: Any, group: Any,
          buffers: StagingBuffers | None = None) -> StagedWrite:
    """Copies ``state`` to host memory now (into ``buffers`` when given) and writes it to
    ``directory`` in DCP's background thread (``dcp.async_save``, over ``group``).

    Raises:
        ConfigError: a value a safe load could not rebuild (before anything is copied).
    """
    state = plain(state, "the checkpoint's entry ")
    per_node = nodes is not None and not nodes.shared
    writer: FileSystemWriter = (_NodeCopiesWriter(directory, nodes) if per_node
                                else _writer(directory))
    writer.report_progress = False  # the watchdog follows the loop, not this thread
    if not _distributed():
        # DCP's thread says it "assumes" one process even when told so (no_dist=True); a
        # catch_warnings there would race the loop's thread (it swaps the global filters).
        warnings.filterwarnings("ignore", message=_SINGLE_SAVE, category=UserWarning)
    staged = (buffers or StagingBuffers()).copy(state)
    with _quiet_single_process():
        future = dcp.async_save(
            staged, storage_writer=writer, process_group=group, no_dist=not _distributed(),
            planner=node_copies.NodeCopiesPlanner(nodes) if per_node else None,
            async_stager=_AlreadyStaged())  # type: ignore[arg-type]

    def finish() -> None:
        future.result()
        if per_node:
            assert isinstance(writer, _NodeCopiesWriter)
            node_copies.distribute(directory, writer.copies,
                                   node_copies.PerNode(layout=nodes, group=group))

    return StagedWrite(future, finish)


def write(state: dict[str, Any], directory: str) -> None:
    """``dcp.save`` of ``state`` (collective; without a process group, this process alone).

    Numpy scalars (a learning rate computed with numpy) are written as Python numbers, which
    a ``weights_only`` load reads back.

    Raises:
        ConfigError: a value a safe load could not rebuild, named, before anything is written
            (every rank holds the same hyper-parameters: every rank raises).
    """
    state = plain(state, "the checkpoint's entry ")
    record = node_copies.active()
    if record is None:
        with _quiet_single_process():
            dcp.save(state, storage_writer=_writer(directory), no_dist=not _distributed())
        return
    # Run directories that are not shared: every node gets a whole copy (node_copies.py).
    writer = _NodeCopiesWriter(directory, record.layout)
    dcp.save(state, storage_writer=writer, planner=node_copies.NodeCopiesPlanner(record.layout),
             process_group=record.group)
    node_copies.distribute(directory, writer.copies, record)


def read(state: dict[str, Any], reader: SafeReader) -> None:
    """``dcp.load`` into ``state`` in place, non-tensor entries through ``weights_only``.

    Raises:
        CheckpointError: a saved tensor of another shape than ``state``'s (it bounds what the
            load allocates: ``load_limits``).
    """
    load_limits.check_shapes(reader.path, state, reader.read_metadata())
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(), no_dist=not _distributed())


def load_sharded(directory: str, models: list[nn.Module], optimizers: list[Optimizer], *,
                 strict: bool = True) -> None:
    """Loads what ``save_sharded`` wrote into the set-up models and optimizers (collective).

    The keys are compared before anything is read: with ``strict``, a model whose keys are not
    exactly the checkpoint's is refused (DCP alone would load a model holding only some of
    them without a word); otherwise the keys both have are loaded. A parameter the saving run's
    optimizer held no state for (it never had a gradient) gets none here either.

    Raises:
        CheckpointError: with ``strict``, keys one side has and the other lacks (named).
    """
    reader = SafeReader(directory)
    saved = set(reader.read_metadata().state_dict_metadata)
    state = _state(models, optimizers)
    partial = False
    for i in range(len(models)):
        missing = check_model_keys(directory, i, state[f"model{i}"], saved, strict=strict)
        for key in missing:
            del state[f"model{i}"][key]
        partial = partial or bool(missing)
        optim_states = state.get(f"optim{i}", {}).get("state", {})
        held, _ = _owners(saved, f"optim{i}.state.", set(optim_states))
        for fqn in set(optim_states) - held:
            del optim_states[fqn]  # no gradient ever reached it in the saving run: no state
            partial = True  # set_state_dict, strict, would refuse the stateless parameter
    # Each group's parameter names as this run has them: without strict, the saved names may
    # include parameters this model no longer has.
    own_names = {key: [list(g["params"]) for g in optim.get("param_groups", [])]
                 for key, optim in state.items() if key.startswith("optim")}
    read(state, reader)
    if not strict:
        for key, names in own_names.items():
            for group, params in zip(state[key]["param_groups"], names, strict=True):
                group["params"] = params
    # The keys were compared above: strict=False here only lets the parts left out stay out.
    options = StateDictOptions(strict=False) if partial else None
    for i, model in enumerate(models):
        opts = _owned(model, optimizers)
        set_state_dict(model, opts, model_state_dict=state[f"model{i}"],
                       optim_state_dict=state.get(f"optim{i}", {}), options=options)


def check_model_keys(directory: str, index: int, model_state: dict[str, Any], saved: set[str],
                     *, strict: bool) -> list[str]:
    """The model's keys that the checkpoint's ``model{index}.`` entries lack.

    Raises:
        CheckpointError: with ``strict``, keys one side has and the other lacks (named).
    """
    missing, unexpected = _compare_keys(model_state, saved, f"model{index}.")
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{directory} does not fit model {index}: the model has {_some(missing)} that the "
            f"checkpoint lacks, the checkpoint has {_some(unexpected)} that the model "
            "lacks; load it into the model it was saved from, or pass strict=False to load "
            "the keys both have"
        )
    return missing


def _compare_keys(model_state: dict[str, Any], saved: set[str], prefix: str
                  ) -> tuple[list[str], list[str]]:
    """(model keys the checkpoint lacks, checkpoint keys the model lacks) under ``prefix``."""
    mine = set(model_state)
    found, unexpected = _owners(saved, prefix, mine)
    return sorted(mine - found), unexpected


def _owners(saved: set[str], prefix: str, mine: set[str]) -> tuple[set[str], list[str]]:
    """The keys of ``mine`` that saved keys under ``prefix`` belong to, and the saved keys that
    belong to none. DCP flattens nested entries (``_extra_state``, an optimizer state's
    tensors) into dotted sub-keys: a saved key belongs to the longest key it starts with."""
    found: set[str] = set()
    unexpected = []
    for key in sorted(k[len(prefix):] for k in saved if k.startswith(prefix)):
        head = key
        while head not in mine and "." in head:
            head = head.rsplit(".", 1)[0]
        if head in mine:
            found.add(head)
        else:
            unexpected.append(key)
    return found, unexpected


def _some(keys: list[str]) -> str:
    if not keys:
        return "no keys"
    shown = ", ".join(repr(k) for k in keys[:4])
    return f"{len(keys)} key(s) ({shown}{', ...' if len(keys) > 4 else ''})"


def _state(models: list[nn.Module], optimizers: list[Optimizer]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        opts = _owned(model, optimizers)
        model_sd, optim_sd = get_state_dict(model, opts)
        state[f"model{i}"] = model_sd
        if opts:
            state[f"optim{i}"] = optim_sd
    return state


def _owned(model: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
    mine = {id(p) for p in model.parameters()}
    return [o for o in optimizers
            if any(id(p) in mine for g in o.param_groups for p in g["params"])]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_SINGLE_SAVE = (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
                r"intent is to save in a single process")


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes" one process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to")
        yield


class _Progress:
    """Tells the watchdog when this rank's files are written: a rank whose disk stalls is then
    named as the one the others wait for (they are all inside the same ``save_state`` phase
    otherwise)."""

    report_progress = True

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)  # type: ignore[misc]
        written.wait()  # the file system writer writes before it returns; a no-op wait
        if self.report_progress:
            fault.advance("acc.save_state, its files written, waiting for the other ranks' "
                          "writes")
        return written


class _ProgressWriter(_Progress, FileSystemWriter):
    """DCP's file writer, with progress for the watchdog."""


class _FsspecProgressWriter(_Progress, FsspecWriter):
    """DCP's fsspec writer (object stores), with progress for the watchdog. ``sync_files``
    off: an object is durable once written, and the fallback for a stream without a file
    descriptor is ``os.sync()`` of the whole machine."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory, sync_files=False, **STORAGE_OPTIONS)


def _writer(directory: str) -> FileSystemWriter:
    return _FsspecProgressWriter(directory) if is_url(directory) else _ProgressWriter(directory)


class _NodeCopiesWriter(_ProgressWriter):
    """The coordinator writes its group's ``.metadata`` and keeps the other groups' copies."""

    def __init__(self, directory: str, layout: Any) -> None:
        super().__init__(directory)
        self.layout = layout
        self.copies: dict[int, bytes] | None = None

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        super().finish(metadata, node_copies.own_results_last(results, self.layout.groups[0]))
        self.copies = node_copies.metadata_copies(metadata, results, self.layout)


class _SafePlanner(DefaultLoadPlanner):
    """Non-tensor entries (optimizer hyper-parameters) read with ``weights_only=True``; torch's
    planner unpickles them with ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        with numpy_floats():
            obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeReader(FileSystemReader):
    """Reads DCP's ``.metadata`` pickle through a whitelist of the classes DCP writes there,
    checks every entry it names before reading any (files inside the checkpoint, sizes within
    the shapes: ``load_limits.check_metadata``) and every entry's zip before ``torch.load``
    inflates it; a local directory or an fsspec URL (as ``FsspecReader``)."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory if not is_url(directory) else ".")
        if is_url(directory):
            from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

            self.fs = FileSystem()
            self.path = self.fs.init_path(directory, **STORAGE_OPTIONS)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"{path} is not a torch.distributed.checkpoint metadata "
                                      f"file or is damaged: {exc}") from exc
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        load_limits.check_metadata(str(self.path), metadata, self._entry_size)
        return metadata

    def _entry_size(self, name: str) -> int | None:
        """The bytes of this checkpoint's file ``name`` (checked to lie inside it); None when
        it is not here (a run directory per node holds its own ranks' shards)."""
        path = inside(self.path, name, ".metadata")
        if isinstance(path, str):  # an object store's URL
            return int(self.fs.fs.size(path)) if self.fs.exists(path) else None
        return path.stat().st_size if path.is_file() else None

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        load_limits.check_torch_zip(
            load_limits.Window(file, sinfo.offset, sinfo.length), sinfo.length,
            f"{sinfo.relative_path} (bytes {sinfo.offset}..{sinfo.offset + sinfo.length})")
        return super()._slice_file(file, sinfo)

    def prepare_local_plan(self, plan: Any) -> Any:
        # Before any read (DCP gathers every rank's error here): a run directory per node holds
        # only its own ranks' shards; a rank of another world may need another node's.
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        missing = sorted(n for n in needed
                         if not self.fs.exists(self.fs.concat_path(self.path, n)))
        if missing:
            shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
            raise CheckpointError(
                f"rank {self.rank}: {self.path} lacks {len(missing)} file(s) this rank needs "
                f"({shown}): they were written on another node's run directory (a run "
                "directory per node holds its own ranks' shards); resume on the ranks and "
                "nodes it was saved on, or copy every node's files of this step into one "
                "directory")
        return super().prepare_local_plan(plan)


class _MetadataUnpickler(pickle.Unpickler):
    """Only the plain records DCP's ``.metadata`` is made of: its metadata dataclasses and
    enums, the storage record of the file system writer, sizes, dtypes and layouts, paths."""

    _METADATA = "torch.distributed.checkpoint.metadata"
    _OTHERS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               *((m, c) for m in ("pathlib", "pathlib._local")  # 3.13 moved the classes
                 for c in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}

    def find_class(self, module: str, name: str) -> Any:
        defined = getattr(importlib.import_module(module), name, None) if (
            module == self._METADATA) else None
        allowed = (
            (isinstance(defined, type) and defined.__module__ == module)  # not Enum, Any, ...
            or (module, name) in self._OTHERS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        return super().find_class(module, name)
