"""What the default recipe trains and validates on: its text files, split by whole files into
documents; the same for both backends."""

from __future__ import annotations

from pathlib import Path

import torch

from accumix.errors import ConfigError
from accumix.recipes.text_data import ByteDocumentDataset, split_files, stdlib_files
from accumix.recipes.train_config import DataConfig, TrainConfig


def text_files(data: DataConfig) -> list[Path]:
    """The recipe's files: the stdlib's ``.py`` files, or ``data.pattern`` under ``data.path``.

    Raises:
        ConfigError: ``data.path`` is not a directory or holds no matching files.
    """
    if data.path is None:
        return stdlib_files(max_files=data.max_files, seed=data.seed)
    root = Path(data.path)
    if not root.is_dir():
        raise ConfigError(f"data.path={data.path!r} is not a directory")
    files = sorted(p for p in root.glob(data.pattern) if p.is_file())
    if len(files) < 2:
        raise ConfigError(f"data.path={data.path!r} has {len(files)} files matching "
                          f"{data.pattern!r}; it needs at least 2 (one is held out)")
    if data.max_files is not None and data.max_files < len(files):
        keep = torch.randperm(len(files), generator=torch.Generator().manual_seed(data.seed))
        files = sorted(files[i] for i in keep[: data.max_files].tolist())
    return files


def datasets(config: TrainConfig) -> tuple[list[Path], list[Path], ByteDocumentDataset,
                                           ByteDocumentDataset]:
    """The recipe's files, split by whole files, and their documents: (train files, held-out
    files, train, validation); the same for both backends."""
    files = text_files(config.data)
    train_files, val_files = split_files(files, config.data.val_fraction, seed=config.data.seed)
    block = config.model.block_size
    train = ByteDocumentDataset(train_files, block, max_bytes=config.data.max_train_bytes)
    val = ByteDocumentDataset(val_files, block, max_bytes=config.data.max_val_bytes)
    return train_files, val_files, train, val
