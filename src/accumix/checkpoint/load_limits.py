"""What loading a checkpoint may make this process allocate, checked before anything is inflated.

A torch file (``torch.save``'s zip) may hold DEFLATE-compressed entries, which ``torch.load``
inflates without a limit: a 0.30 MiB ``rank-0.pt`` of compressed zeros made the load allocate
306 MiB. torch itself never compresses what it saves, so a file accumix reads must hold only
*stored* entries, whose bytes are what is on disk: a load then allocates at most what the file
holds, and each file is also held to what it should hold:

* ``rank-N.pt`` and ``schedulers.pt`` (RNG and LR-scheduler states, a few KiB): 64 MiB;
* a DCP entry (``.distcp``): the bytes its chunk's shape and dtype in ``.metadata`` give, and
  the shapes in ``.metadata`` must be this run's (``check_shapes``), so the model bounds it;
* DCP's ``.metadata`` itself: every entry's file inside the checkpoint
  (``accumix.common.safe_paths``), within that file's size, no decoding transform (DCP's
  optional zstd stream: accumix never writes one).

A file past its bound is refused in one line naming it, before ``torch.load`` sees it.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from accumix.errors import CheckpointError

MiB = 2**20
SMALL_FILE_LIMIT = 64 * MiB  # rank-N.pt, schedulers.pt: RNG and scheduler states (KiBs)
BYTES_ENTRY_LIMIT = 16 * MiB  # a DCP non-tensor entry (optimizer hyper-parameters, names)
# A DCP tensor entry is one torch.save of its chunk: the chunk's bytes plus the zip's headers,
# the pickle and 64-byte alignment padding.
ENTRY_OVERHEAD = 1 * MiB


def check_torch_zip(file: str | os.PathLike[str] | IO[bytes], limit: int, what: str) -> None:
    """Refuses a ``torch.save`` file whose entries would inflate, or hold more than ``limit``.

    Reads only the zip's central directory.

    Args:
        file: a path, or a seekable binary file object holding just the file (``window``).
        limit: the most bytes its entries may hold, all together.
        what: the file's name for the message.

    Raises:
        CheckpointError: not a zip, a compressed entry, or more than ``limit`` bytes.
    """
    try:
        with zipfile.ZipFile(file) as archive:  # type: ignore[arg-type]
            entries = archive.infolist()
    except FileNotFoundError:
        return  # the caller's own read names the missing file
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        # torch's legacy (pre-zip) format allocates each storage at the size its pickle
        # declares before reading it: refused as well; torch.save has written zips since 1.6.
        raise CheckpointError(f"{what} cannot be read: not a torch.save zip file ({exc}); the "
                              "checkpoint is damaged or was not written by accumix") from None
    packed = [e for e in entries if e.compress_type != zipfile.ZIP_STORED
              or e.file_size != e.compress_size]
    if packed:
        raise CheckpointError(
            f"{what} holds compressed entries ({sum(e.compress_size for e in packed):,} bytes "
            f"that inflate to {sum(e.file_size for e in packed):,}); torch.save never "
            "compresses, so it was not written by torch: refused before inflating it (was the "
            "checkpoint tampered with?)")
    check_size(sum(e.file_size for e in entries), limit, what)


def check_size(size: int, limit: int, what: str) -> None:
    """Refuses ``size`` bytes past ``limit`` for the file ``what``.

    Raises:
        CheckpointError: ``size > limit``.
    """
    if size > limit:
        raise CheckpointError(
            f"{what} holds {size:,} bytes, more than the {limit:,} such a file holds at most; "
            "refused before reading it (was the checkpoint tampered with?)")


class Window(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of a seekable stream as a file of their own (one
    DCP entry), for ``zipfile``: torch's own view gets ``seek(-n, SEEK_END)`` wrong."""

    def __init__(self, base: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._base, self._offset, self._length, self._pos = base, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET, /) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(start + pos, 0), self._length)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._length - self._pos)
        if size <= 0:
            return 0
        self._base.seek(self._offset + self._pos)
        data = self._base.read(size)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


def check_metadata(directory: str, metadata: Any,
                   entry_size: Callable[[str], int | None]) -> None:
    """Checks DCP's ``.metadata`` against the files beside it, before any entry is read.

    Every entry's file stays in ``directory`` (``entry_size`` checks the name and gives the
    file's bytes, None for a file not here: another node's shards, refused only when a rank
    needs it), its bytes lie within that file, it names no decoding transform, and a tensor
    entry holds no more than its chunk's shape and dtype give (a non-tensor entry: 16 MiB);
    every chunk lies inside its tensor's size.

    Raises:
        CheckpointError: the first entry that does not, named.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = f"{directory.rstrip('/')}/.metadata"
    entries = metadata.state_dict_metadata
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                if len(chunk.offsets) != len(md.size) or any(
                        o < 0 or s < 0 or o + s > n
                        for o, s, n in zip(chunk.offsets, chunk.sizes, md.size, strict=True)):
                    raise CheckpointError(f"{where}: a chunk of {fqn} lies outside its size "
                                          f"{tuple(md.size)}; the checkpoint is damaged")
    sizes: dict[str, int | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = info.relative_path
        if name not in sizes:
            sizes[name] = entry_size(name)
        if info.transform_descriptors:
            raise CheckpointError(
                f"{where}: {index.fqn} is stored through {list(info.transform_descriptors)}; "
                "accumix writes plain entries only: refused before decoding it")
        size = sizes[name]
        if info.offset < 0 or info.length < 0 or (
                size is not None and info.offset + info.length > size):
            raise CheckpointError(
                f"{where}: {index.fqn} lies at bytes {info.offset}..{info.offset + info.length} "
                f"of {name}, which has {size}; the checkpoint is torn or damaged")
        bound = entry_limit(entries.get(index.fqn), index)
        if info.length > bound:
            raise CheckpointError(
                f"{where}: {index.fqn} takes {info.length:,} bytes of {name}, more than the "
                f"{bound:,} its shape in .metadata allows; refused before reading it")


def entry_limit(md: Any, index: Any) -> int:
    """The most bytes one stored DCP entry may take: its chunk's bytes plus the zip's own."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(md, TensorStorageMetadata):
        return BYTES_ENTRY_LIMIT
    chunk = next((c for c in md.chunks if index.offset is not None
                  and tuple(c.offsets) == tuple(index.offset)), None)
    sizes = chunk.sizes if chunk is not None else md.size
    itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
    return math.prod(sizes) * itemsize + ENTRY_OVERHEAD


def check_shapes(directory: str | os.PathLike[str], state: Mapping[str, Any],
                 metadata: Any) -> None:
    """Refuses a checkpoint whose tensors have other shapes than the ones loaded into.

    DCP reads every saved chunk that overlaps a destination whole: a ``.metadata`` declaring a
    larger tensor than the model's would make it read (and allocate) the larger one.

    Raises:
        CheckpointError: the first entry whose shape differs, named with both shapes.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(dict(state))
    entries = metadata.state_dict_metadata
    for fqn, value in flat.items():
        md = entries.get(fqn)
        if not torch.is_tensor(value) or not isinstance(md, TensorStorageMetadata):
            continue
        if tuple(md.size) != tuple(value.shape):
            raise CheckpointError(
                f"{Path(directory)}: {fqn} is {tuple(md.size)} in the checkpoint, "
                f"{tuple(value.shape)} in this run; load it into the model (and optimizer) it "
                "was saved from")
