"""Runnable jobs; the default is a small byte-level GPT on the Python standard library's source."""

from __future__ import annotations

from accumix.recipes.gpt import GPT, Block, GPTConfig
from accumix.recipes.text_data import (
    ByteDocumentDataset,
    decode,
    encode,
    pad_collate,
    split_files,
    stdlib_files,
)

__all__ = [
    "GPT",
    "Block",
    "ByteDocumentDataset",
    "GPTConfig",
    "decode",
    "encode",
    "pad_collate",
    "split_files",
    "stdlib_files",
]
