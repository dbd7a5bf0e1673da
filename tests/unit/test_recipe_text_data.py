from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accumix.recipes.text_data import (
    ByteDocumentDataset,
    decode,
    encode,
    pad_collate,
    split_files,
    stdlib_files,
)


def test_stdlib_files_are_deterministic_and_non_empty() -> None:
    files = stdlib_files()
    assert len(files) > 50
    assert files == stdlib_files()
    assert all(path.suffix == ".py" and path.is_file() for path in files)
    assert not any("site-packages" in path.parts for path in files)
    subset = stdlib_files(max_files=20, seed=3)
    assert len(subset) == 20
    assert subset == stdlib_files(max_files=20, seed=3)
    assert set(subset) <= set(files)
    assert subset != stdlib_files(max_files=20, seed=4)


def test_split_is_disjoint_complete_and_deterministic() -> None:
    files = stdlib_files(max_files=40)
    train, val = split_files(files, val_fraction=0.1, seed=0)
    assert len(val) == 4
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(files)
    assert (train, val) == split_files(list(reversed(files)), val_fraction=0.1, seed=0)
    with pytest.raises(ValueError):
        split_files(files, val_fraction=1.0)


def test_documents_have_variable_lengths_up_to_block_plus_one() -> None:
    block_size = 64
    dataset = ByteDocumentDataset(stdlib_files(max_files=10), block_size, max_bytes=50_000)
    lengths = {len(dataset[i]) for i in range(len(dataset))}
    assert len(lengths) >= 2
    assert max(lengths) == block_size + 1
    assert min(lengths) >= 2
    assert dataset.data.numel() <= 50_000
    assert dataset[0].dtype == torch.int64


def test_windows_cover_a_file_with_one_shared_byte(tmp_path: Path) -> None:
    text = b"abcdefghij"  # 10 bytes, block_size 4: windows at 0, 4, 8
    (tmp_path / "a.py").write_bytes(text)
    (tmp_path / "b.py").write_bytes(b"x")  # one byte: no target, no document
    dataset = ByteDocumentDataset([tmp_path / "a.py", tmp_path / "b.py"], 4)
    docs = [bytes(dataset[i].tolist()) for i in range(len(dataset))]
    assert docs == [b"abcde", b"efghi", b"ij"]
    assert dataset.num_targets == len(text) - 1


def test_pad_collate_shapes_and_mask() -> None:
    docs = [torch.arange(2, 7), torch.arange(10, 12), torch.arange(20, 29)]  # lengths 5, 2, 9
    batch = pad_collate(docs, pad_id=0)
    input_ids, labels = batch["input_ids"], batch["labels"]
    assert input_ids.shape == labels.shape == (3, 8)
    assert input_ids.dtype == labels.dtype == torch.int64
    real = sum(len(doc) - 1 for doc in docs)
    assert int((labels != -100).sum()) == real
    assert int((labels == -100).sum()) == 3 * 8 - real
    assert input_ids[0].tolist() == [2, 3, 4, 5, 0, 0, 0, 0]
    assert labels[0].tolist() == [3, 4, 5, 6, -100, -100, -100, -100]
    assert labels[2].tolist() == list(range(21, 29))
    with pytest.raises(ValueError):
        pad_collate([torch.tensor([1])])


def test_pad_collate_works_with_a_dataloader() -> None:
    dataset = ByteDocumentDataset(stdlib_files(max_files=5), 32, max_bytes=5_000)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=pad_collate)
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 8
    assert batch["input_ids"].shape[1] <= 32


def test_encode_decode_round_trip() -> None:
    text = "def f(x):\n    return x + 1  # ASCII\n"
    ids = encode(text)
    assert ids.dtype == torch.int64 and len(ids) == len(text)
    assert decode(ids) == text
    assert decode(encode("héllo")) == "héllo"
    assert decode([0xC3]) == "\ufffd"
    assert encode("").numel() == 0
