"""Evaluation in a plain loop over ranks (issue 44), on 2 ranks (the shared spawn) and 3 (one
job), datasets of 131, 7 and 1 samples that neither world divides.

- ``acc.gather_for_metrics`` over a set-up loader: every sample once, in dataset order (the
  sampler's permutation when shuffled); accuracy and F1 from it equal the one-process values
  (before: no such call; ``acc.gather`` gave 132 predictions for 131 samples on 2 ranks).
- ``acc.setup_eval_loader``: each sample on one rank (blocks, no padding); ``acc.reduce`` of the
  metric's counts and ``acc.gather`` of the rows after the loop are the one-process values.
- ``acc.gather`` of unequal rows (nested, 0-dim, int64 past 2**53, bool, a rank with none)
  equals the concatenation (before: gloo aborted the process or returned rows of zeros); a
  trailing shape or dtype that differs is one line on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.testing import spawn
from tests.distributed.shared_spawn import shared_result

SIZES = {131: 8, 7: 2, 1: 4}  # samples: batch size
# Integer inputs and weights: the logits are exact, so predictions never depend on batching.
WEIGHT = torch.tensor([[1.0, -2.0], [0.0, 1.0], [2.0, 1.0], [-1.0, 0.0]])


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(samples)
    return TensorDataset(torch.arange(samples), torch.randint(-3, 4, (samples, 4),
                                                                generator=g).float(),
                         torch.randint(0, 2, (samples,), generator=g))


def predict(x: torch.Tensor) -> torch.Tensor:
    return (x @ WEIGHT).argmax(-1)


def counts(predictions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """correct, true positives, false positives, false negatives, samples."""
    return torch.stack([(predictions == labels).sum(), ((predictions == 1) & (labels == 1)).sum(),
                        ((predictions == 1) & (labels == 0)).sum(),
                        ((predictions == 0) & (labels == 1)).sum(),
                        torch.tensor(len(labels))])


def accuracy_f1(c: list[int]) -> tuple[float, float]:
    correct, tp, fp, fn, samples = c
    return correct / samples, 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def _errors(acc: ax.Accelerator, calls: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except ax.ConfigError as exc:
            out[name] = str(exc)
    return out


def eval_job() -> dict[str, Any]:
    acc = ax.Accelerator(strategy="ddp", precision="fp32")
    rank, world = acc.rank, acc.world_size
    result: dict[str, Any] = {}
    for samples, batch in SIZES.items():
        data = dataset(samples)
        for shuffle in (False, True):
            loader = acc.setup(DataLoader(data, batch_size=batch, shuffle=shuffle))
            index, predictions, labels = [], [], []
            for i, x, y in loader:
                got = acc.gather_for_metrics({"index": i, "rows": (predict(x), y)})
                index.append(got["index"])
                predictions.append(got["rows"][0])
                labels.append(got["rows"][1])
            predictions, labels = torch.cat(predictions), torch.cat(labels)
            result[f"setup-{samples}-{shuffle}"] = {
                "index": torch.cat(index).tolist(),
                "counts": counts(predictions, labels).tolist()}
        loader = acc.setup_eval_loader(DataLoader(data, batch_size=batch))
        total, rows = torch.zeros(5, dtype=torch.long), []
        with torch.no_grad():
            for i, x, y in loader:
                total += counts(predict(x), y)
                rows.append(i)
        mine = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        result[f"eval-{samples}"] = {"counts": acc.reduce(total, "sum").tolist(),
                                     "index": acc.gather(mine).tolist(),
                                     "batches": loader.batches_per_rank}
    # acc.gather: the issue's [0, 1] on rank 0 and [10] on rank 1 (and [20, 21, 22] on rank 2),
    # nested with a 0-dim leaf, int64 past float's range and bool; then rank 0 with no rows.
    ints = [torch.tensor([0, 1]), torch.tensor([10]), torch.tensor([20, 21, 22])][rank]
    got = acc.gather({"ids": ints + 2**53, "pair": (ints > 10, torch.tensor(rank + 0.5))})
    result["gather"] = {"ids": (got["ids"] - 2**53).tolist(), "hit": got["pair"][0].tolist(),
                        "scalar": got["pair"][1].tolist()}
    empty_first = torch.arange(rank * 2, dtype=torch.float64).reshape(rank, 2)
    result["gather_empty"] = acc.gather(empty_first).tolist()
    # Mismatches, on every rank alike (ranks > 0 send [1, 4]).
    wide = torch.zeros(2, 3) if rank == 0 else torch.zeros(1, 4)
    data = dataset(131)
    eval_loader = acc.setup_eval_loader(DataLoader(data, batch_size=8))
    padded = acc.setup(DataLoader(data, batch_size=8))
    it = iter(padded)
    _, x, _ = next(it)
    result["errors"] = _errors(acc, {
        "trailing": lambda: acc.gather(wide),
        "dtype": lambda: acc.gather(torch.zeros(1, dtype=torch.float64 if rank else torch.float32)),
        "nesting": lambda: acc.gather({"a": torch.zeros(1)} if rank else {"b": torch.zeros(1)}),
        "per_batch": lambda: acc.gather_for_metrics(x.sum()),
        "per_token": lambda: acc.gather_for_metrics(x.reshape(-1)),
    })
    it.close()
    it = iter(eval_loader)
    next(it)
    result["errors"].update(_errors(acc, {"eval_loader": lambda: acc.gather_for_metrics(x)}))
    it.close()
    result["world"] = world
    acc.end()
    return result


def check(ranks: list[dict[str, Any]]) -> None:
    """What every rank of a job must have found."""
    world = len(ranks)
    for samples in SIZES:
        data = dataset(samples)
        _, x, y = data.tensors
        expected = counts(predict(x), y).tolist()
        accuracy, f1 = accuracy_f1(expected)
        permutation = torch.randperm(samples, generator=torch.Generator().manual_seed(0)).tolist()
        for r in ranks:
            plain, shuffled = r[f"setup-{samples}-False"], r[f"setup-{samples}-True"]
            assert plain["index"] == list(range(samples)), (world, samples)
            assert shuffled["index"] == permutation, (world, samples)  # the sampler's order
            for got in (plain, shuffled, r[f"eval-{samples}"]):
                assert got["counts"] == expected, (world, samples)
                assert accuracy_f1(got["counts"]) == (accuracy, f1)
            assert r[f"eval-{samples}"]["index"] == list(range(samples))
    assert ranks[0]["eval-7"]["batches"] == {2: [2, 2], 3: [2, 1, 1]}[world]
    assert ranks[0]["eval-1"]["batches"] == [1] + [0] * (world - 1)
    ids = [0, 1, 10, 20, 21, 22][:{2: 3, 3: 6}[world]]
    shapes = ", ".join(f"rank {r} {'[2, 3]' if r == 0 else '[1, 4]'} float32"
                       for r in range(world))
    dtypes = ", ".join(f"rank {r} [1] {'float64' if r else 'float32'}" for r in range(world))
    nestings = ", ".join(f"rank {r} ['{'a' if r else 'b'}']" for r in range(world))
    for r in ranks:
        assert r["gather"] == {"ids": ids, "hit": [i > 10 for i in ids],
                               "scalar": [k + 0.5 for k in range(world)]}
        # rank k holds k rows [2i, 2i + 1]: rank 0 none
        assert r["gather_empty"] == [[2.0 * i, 2.0 * i + 1] for k in range(world)
                                     for i in range(k)]
        errors = r["errors"]
        assert errors["trailing"] == (
            "acc.gather needs the same shape after the first dimension and the same dtype on "
            f"every rank: {shapes}; only the first dimension may differ")
        assert errors["dtype"] == (
            "acc.gather needs the same shape after the first dimension and the same dtype on "
            f"every rank: {dtypes}; only the first dimension may differ")
        assert errors["nesting"] == (f"acc.gather got different nestings on the ranks: "
                                     f"{nestings}; give every rank the same keys and lengths")
        assert errors["per_batch"].startswith(
            "acc.gather_for_metrics drops the padding rows of the current batch, so each tensor "
            "needs one row per sample of it: rank 0 [] for 8 rows")
        assert errors["per_token"].startswith(
            "acc.gather_for_metrics drops the padding rows of the current batch, so each tensor "
            "needs one row per sample of it: rank 0 [32] for 8 rows")
        assert errors["eval_loader"].startswith(
            "acc.gather_for_metrics got a batch of acc.setup_eval_loader's loader")


def shared_job(_: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's 2-rank job, run in the spawn it shares with other modules (conftest.py)."""
    return eval_job, ()


def test_two_ranks_evaluate_every_sample_once(shared_spawn: dict[str, list[Any]]) -> None:
    check(shared_result(shared_spawn, __name__))


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return spawn(eval_job, 3, timeout=600)


def test_three_ranks_evaluate_every_sample_once(three_ranks: list[dict[str, Any]]) -> None:
    check(three_ranks)
