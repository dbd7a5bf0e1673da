"""Real text that every machine has: the Python standard library's own source, as bytes.

No download, no tokenizer: documents are byte strings cut from ``.py`` files, so they have
naturally different lengths (the last piece of each file is short). That is the point for this
library: a token-weighted loss gives a different answer from a per-batch mean here, so the
item-weighted ``backward(loss_sum, num_items=n)`` is exercised on real data.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100

# Skipped under the stdlib root: third-party code, and the test suites, which are large and
# full of deliberately odd encodings.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_files(max_files: int | None = None, seed: int = 0) -> list[Path]:
    """List the standard library's ``.py`` files, in a fixed order.

    The list depends only on the Python installation (and on ``max_files``/``seed``), never on
    the file system's directory order.

    Args:
        max_files: keep a random subset of this many files (drawn with ``seed``), for small
            runs and tests; None for all of them.
        seed: seed of the subset draw.

    Returns:
        Paths sorted by their path relative to the stdlib directory.

    Raises:
        FileNotFoundError: the stdlib is not a directory of ``.py`` files here (e.g. a
            zipped stdlib in an embedded Python).
        ValueError: ``max_files`` is below 1.
    """
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None, got {max_files}")
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    # os.walk with pruning, not rglob: site-packages can hold far more files than the stdlib.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames if name not in _SKIP_DIRS]
        found.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    files = sorted(
        (path for path in found if path.is_file()),
        key=lambda path: path.relative_to(root).as_posix(),
    )
    if not files:
        raise FileNotFoundError(f"no standard-library .py files found under {root}")
    if max_files is not None and max_files < len(files):
        keep = set(random.Random(seed).sample(range(len(files)), max_files))
        files = [path for i, path in enumerate(files) if i in keep]
    return files


def split_files(
    files: Iterable[Path], val_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Path], list[Path]]:
    """Hold out whole files for validation, so no validation text was seen in training.

    Args:
        files: the files to split; their order does not matter.
        val_fraction: share of files held out, in ``[0, 1)``; at least one file is held out
            when it is above 0.
        seed: seed of the shuffle that picks the held-out files.

    Returns:
        ``(train_files, val_files)``, disjoint, each sorted.

    Raises:
        ValueError: ``val_fraction`` is out of range, or nothing would be left to train on.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    # Sort first so the split depends on the set of files, not on the order they came in.
    shuffled = sorted(set(files), key=str)
    random.Random(seed).shuffle(shuffled)
    num_val = max(1, round(len(shuffled) * val_fraction)) if val_fraction > 0 else 0
    if num_val >= len(shuffled):
        raise ValueError(
            f"cannot hold out {num_val} of {len(shuffled)} files and still have training files"
        )
    return sorted(shuffled[num_val:], key=str), sorted(shuffled[:num_val], key=str)


class ByteDocumentDataset(Dataset):
    """Variable-length byte documents cut from text files.

    Each file is cut into windows of at most ``block_size + 1`` bytes starting every
    ``block_size`` bytes, so consecutive windows share one byte: the last byte of a window is
    the first input of the next, and every byte after a file's first is a target exactly once.
    A file's last window is shorter; windows of one byte (no target) are dropped.

    All bytes live in one ``uint8`` tensor with a start and a length per document.

    Args:
        files: text files, read as raw bytes (UTF-8 source stays UTF-8).
        block_size: the model's context length; documents hold up to ``block_size + 1`` bytes.
        max_bytes: stop reading once this many bytes are stored (the last file is cut there);
            None to read everything.

    Raises:
        ValueError: ``block_size`` or ``max_bytes`` is below 1, or no document came out.
    """

    def __init__(
        self, files: Sequence[Path], block_size: int, *, max_bytes: int | None = None
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
        self.block_size = block_size
        chunks: list[bytes] = []
        starts: list[int] = []
        lengths: list[int] = []
        stored = 0
        for path in files:
            if max_bytes is not None and stored >= max_bytes:
                break
            data = Path(path).read_bytes()
            if max_bytes is not None:
                data = data[: max_bytes - stored]
            # A window must start before the last byte to have a target.
            for offset in range(0, len(data) - 1, block_size):
                starts.append(stored + offset)
                lengths.append(min(block_size + 1, len(data) - offset))
            chunks.append(data)
            stored += len(data)
        if not starts:
            raise ValueError("no documents: the files are empty or shorter than two bytes")
        joined = b"".join(chunks)
        self.data = torch.frombuffer(bytearray(joined), dtype=torch.uint8)
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.lengths = torch.tensor(lengths, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        """Return document ``index`` as a new ``LongTensor`` of 2 to ``block_size + 1`` bytes."""
        start = int(self.starts[index])
        # A copy, not a view: a view would carry the whole byte store through a DataLoader
        # worker's shared-memory queue.
        return self.data[start : start + int(self.lengths[index])].to(torch.int64)

    @property
    def num_targets(self) -> int:
        """Number of next-byte targets over all documents (each document's length minus one)."""
        return int(self.lengths.sum()) - len(self)


def pad_collate(batch: Sequence[torch.Tensor], pad_id: int = 0, length: int | None = None
                ) -> dict[str, torch.Tensor]:
    """Turn documents into next-token inputs and labels, padded to the batch's longest.

    Args:
        batch: 1-D integer tensors of at least two tokens each.
        pad_id: id placed in padded input positions (their labels are ``-100``).
        length: pad every batch to this many positions instead (static shapes for a jitted
            step, which would recompile for each new length).

    Returns:
        ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` with ``T`` the longest
        document's length minus one; ``labels[i, j]`` is document ``i``'s token ``j + 1``, or
        ``-100`` past its end.

    Raises:
        ValueError: the batch is empty or holds a document shorter than two tokens.
    """
    if len(batch) == 0:
        raise ValueError("pad_collate got an empty batch")
    shortest = min(len(doc) for doc in batch)
    if shortest < 2:
        raise ValueError(f"documents need at least 2 tokens to have a target, got {shortest}")
    seq = max(len(doc) for doc in batch) - 1
    if length is not None:
        if seq > length:
            raise ValueError(f"a document of {seq + 1} tokens does not fit length={length}")
        seq = length
    input_ids = torch.full((len(batch), seq), pad_id, dtype=torch.int64)
    labels = torch.full((len(batch), seq), IGNORE_INDEX, dtype=torch.int64)
    for row, doc in enumerate(batch):
        doc = torch.as_tensor(doc, dtype=torch.int64)
        input_ids[row, : len(doc) - 1] = doc[:-1]
        labels[row, : len(doc) - 1] = doc[1:]
    return {"input_ids": input_ids, "labels": labels}


def encode(text: str) -> torch.Tensor:
    """Encode text as its UTF-8 bytes.

    Args:
        text: any string.

    Returns:
        ``LongTensor[len(text.encode("utf-8"))]`` of values 0-255.
    """
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(ids: torch.Tensor | Iterable[int]) -> str:
    """Decode byte ids to text; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD.

    Args:
        ids: a 1-D tensor or iterable of ints in 0-255.

    Returns:
        The decoded string.

    Raises:
        ValueError: an id is outside 0-255.
    """
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")
