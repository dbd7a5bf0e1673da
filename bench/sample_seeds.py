"""What per-sample random streams cost: an epoch read plainly vs through accumix's loader.

    python bench/sample_seeds.py                    # 4096 samples of 3x32x32, batch 64
    python bench/sample_seeds.py --samples 256      # a smoke run

A CIFAR-sized dataset draws a random crop offset and a flip (torch), brightness (numpy) and a
coin (python) per sample: the cheapest augmentation a real vision job has, so the seeding's
share is as large as it gets. Rows, each over the same epoch (median of ``--repeats``):

* plain: the user's ``DataLoader`` (``num_workers=0``);
* accumix: ``AcceleratedDataLoader`` around it (each sample under its own seeded streams,
  the caller's states restored once a batch);
* accumix, TensorDataset: the same tensors without augmentation, which is read as it is (the
  control: the loader's own cost without seeding).

"x" is the row's time over plain's; "us/sample" the difference per sample.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from _common import machine_line, markdown_table, median
from accumix.data.loader import AcceleratedDataLoader


class Cifarish(Dataset):
    def __init__(self, n: int) -> None:
        self.images = torch.rand(n, 3, 36, 36)
        self.labels = torch.randint(0, 10, (n,))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        dx, dy = torch.randint(0, 5, (2,)).tolist()
        image = self.images[i, :, dy:dy + 32, dx:dx + 32]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = image * float(np.random.uniform(0.8, 1.2))
        if random.random() < 0.1:
            image = image.mean(0, keepdim=True).expand(3, -1, -1)
        return image, self.labels[i]


def _epoch_time(loader: object) -> float:
    start = time.perf_counter()
    for _ in loader:  # type: ignore[attr-defined]
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Cifarish(args.samples)
    tensors = TensorDataset(data.images[:, :, :32, :32].contiguous(), data.labels)

    def wrapped(dataset: Dataset) -> AcceleratedDataLoader:
        return AcceleratedDataLoader(DataLoader(dataset, batch_size=args.batch, shuffle=True),
                                     device=torch.device("cpu"), rank=0, world_size=1, seed=0,
                                     on_batch=lambda _: None)

    rows = {
        "plain": DataLoader(data, batch_size=args.batch, shuffle=True),
        "accumix": wrapped(data),
        "plain, TensorDataset": DataLoader(tensors, batch_size=args.batch, shuffle=True),
        "accumix, TensorDataset": wrapped(tensors),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits all rows
        for name, loader in rows.items():
            times[name].append(_epoch_time(loader))
    print(machine_line())
    print(f"{args.samples} samples of 3x32x32 in batches of {args.batch}, num_workers=0, "
          f"median of {args.repeats} epochs")
    table = []
    for name in rows:
        base = median(times["plain" if "Tensor" not in name else "plain, TensorDataset"])
        t = median(times[name])
        table.append([name, f"{t * 1e3:.1f}", f"{t / base:.3f}x",
                      f"{(t - base) / args.samples * 1e6:+.1f}"])
    print(markdown_table(["loader", "epoch ms", "x", "us/sample"], table))


if __name__ == "__main__":
    main()
