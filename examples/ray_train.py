"""The torchrun loop, unchanged, under Ray Train's ``TorchTrainer`` (docs/guides/ray.md).

    python examples/ray_train.py --storage-path /tmp/ray-results        # a local Ray cluster
    RAY_ADDRESS=auto python examples/ray_train.py --storage-path s3://bucket/ray-results

Nothing in ``train_loop`` is Ray's: accumix reads Ray's ranks, process group and device, and
``acc.save_state`` hands each checkpoint to Ray, which copies it to ``storage_path`` (no
``ray.train.report`` in the loop). When a worker fails, Ray restarts the group (``FailureConfig``)
and ``latest_checkpoint`` / ``acc.load_state`` resume from the newest checkpoint every worker
uploaded, downloaded into the run directory of a worker whose node lost it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ray.train import CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.checkpoint import latest_checkpoint


def make_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def train_loop(config: dict[str, Any]) -> None:
    """The loop as written for torchrun (``accumix launch``): nothing in it is Ray's."""
    acc = ax.Accelerator(strategy=config.get("strategy", "ddp"), precision="fp32",
                         global_batch_size=16, micro_batch_size=2, seed=0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(), batch_size=2)
    model, optimizer, loader = acc.setup(model, optimizer, loader)
    run_dir = config["run_dir"]               # a local disk on each node is enough
    if latest_checkpoint(run_dir):            # after Ray restarted the workers
        acc.load_state(run_dir)
    steps, save_every = config.get("steps", 6), config.get("save_every", 2)
    while acc.optimizer_steps < steps:
        for x, y in loader:
            with acc.accumulate():
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if acc.sync_gradients and save_every and acc.optimizer_steps % save_every == 0:
                acc.save_state(run_dir, keep_last=2,   # to Ray too, with these metrics
                               metrics={"loss": loss.item(), "step": acc.optimizer_steps})
            if acc.optimizer_steps >= steps:
                break
    acc.save_model(Path(run_dir) / "model")   # model.safetensors, on rank 0's node
    acc.end()


def make_trainer(storage_path: str, *, name: str = "accumix-ray", workers: int = 2,
                 use_gpu: bool = False, max_failures: int = 3, num_to_keep: int | None = 2,
                 loop: Callable[[dict[str, Any]], None] = train_loop,
                 config: dict[str, Any] | None = None) -> TorchTrainer:
    """``workers`` Ray workers running ``loop``; a failed worker restarts the group up to
    ``max_failures`` times, and Ray keeps the newest ``num_to_keep`` checkpoints in
    ``storage_path``."""
    return TorchTrainer(
        loop,
        train_loop_config={"run_dir": "/tmp/accumix-ray/job", **(config or {})},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)),
    )


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", required=True, help="a shared path or s3://, gs://")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args(argv)
    result = make_trainer(args.storage_path, workers=args.workers, use_gpu=args.gpu,
                          config={"strategy": args.strategy}).fit()
    print(f"done: {result.metrics}; newest checkpoint {result.checkpoint}")
    return result


if __name__ == "__main__":
    main()
