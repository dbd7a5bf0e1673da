"""accumix.jax's loop, unchanged, under Ray Train's ``JaxTrainer`` (docs/guides/ray.md).

    python examples/ray_train_jax.py --storage-path /tmp/ray-results     # a local Ray cluster

On CPUs Ray starts no ``jax.distributed`` (only for GPUs and TPUs): accumix starts it from Ray's
context, so the workers are one job of N processes, not N jobs of one. ``acc.save_state`` hands
each checkpoint to Ray and a restarted worker resumes from Ray's copy, as with ``TorchTrainer``
(``examples/ray_train.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from ray.train import CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig
from ray.train.v2.jax import JaxTrainer
from torch.utils.data import DataLoader

import accumix.jax as axj
from accumix.checkpoint import latest_checkpoint


class Rows:
    """64 rows of a regression (a map-style dataset of numpy rows)."""

    def __init__(self, n: int = 64) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 8)).astype(np.float32)
        self.y = np.tanh(self.x @ rng.normal(size=(8, 1))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": self.x[i], "y": self.y[i]}


def init_params() -> dict[str, Any]:
    rng = np.random.default_rng(1)
    return {"hidden": {"w": rng.normal(size=(8, 16)).astype(np.float32) * 0.3,
                       "b": np.zeros(16, np.float32)},
            "out": {"w": rng.normal(size=(16, 1)).astype(np.float32) * 0.3,
                    "b": np.zeros(1, np.float32)}}


def loss_fn(params: Any, batch: dict[str, Any], rng: Any) -> Any:
    hidden = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"])
    return jnp.mean((hidden @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2)


def train_loop(config: dict[str, Any]) -> None:
    """The loop as written for ``accumix launch``: nothing in it is Ray's."""
    acc = axj.Accelerator(strategy=config.get("strategy", "ddp"), precision="fp32",
                          global_batch_size=16, micro_batch_size=4, seed=0)
    state, windows = acc.setup(init_params(), optax.adamw(1e-2),
                               DataLoader(Rows(), batch_size=4))
    run_dir = config["run_dir"]
    if latest_checkpoint(run_dir):             # after Ray restarted the workers
        state = acc.load_state(run_dir, state)
    step = acc.train_step(loss_fn)
    steps, save_every = config.get("steps", 6), config.get("save_every", 2)
    while int(state.step) < steps:
        for window in windows:                 # K micro-batches of this process
            state, metrics = step(state, window)
            if save_every and int(state.step) % save_every == 0:
                acc.save_state(run_dir, state, keep_last=2,
                               metrics={"loss": float(metrics["loss"]), "step": int(state.step)})
            if int(state.step) >= steps:
                break
    acc.save_model(Path(run_dir) / "model", state)   # model.safetensors, process 0 writes


def make_trainer(storage_path: str, *, name: str = "accumix-ray-jax", workers: int = 2,
                 max_failures: int = 3, num_to_keep: int | None = 2,
                 loop: Callable[[dict[str, Any]], None] = train_loop,
                 config: dict[str, Any] | None = None) -> JaxTrainer:
    """``workers`` CPU workers running ``loop`` (``ScalingConfig(use_gpu=True)`` or
    ``use_tpu=True`` on accelerators, where Ray starts JAX itself)."""
    return JaxTrainer(
        loop,
        train_loop_config={"run_dir": "/tmp/accumix-ray-jax/job", **(config or {})},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)),
    )


def main(argv: list[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", required=True, help="a shared path or s3://, gs://")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    result = make_trainer(args.storage_path, workers=args.workers).fit()
    print(f"done: {result.metrics}; newest checkpoint {result.checkpoint}")
    return result


if __name__ == "__main__":
    main()
