"""What every Ray Train worker runs in tests/distributed/test_ray_train.py: several cases per
``fit``, chained across one restart by Ray (a worker group start costs seconds); each attempt's
facts go to ``config["out"]/a<attempt>-r<rank>.json`` for the test to check.

``torch_cases`` (``TorchTrainer``, 2 workers, ``FailureConfig(max_failures=1)``), each worker
with its own run directories (no shared filesystem):

* attempt 0: where accumix thinks it runs; ``examples/ray_train.py``'s loop without saves under
  ddp and fsdp (the references); the Trainer ``T`` on the same job, saving every 2 steps with
  Ray's ASYNC upload: Ray's pre-emption notice during step 1 makes it save there and go on,
  and it is stopped after its save at step 2 once Ray holds it; the example's loop ``L``
  saving every step until step 3, when worker 1's run directory is deleted (its node is lost)
  and it is SIGKILLed right after the save, before Ray's controller polls it;
* attempt 1: ``accumix train`` (the default recipe, shrunk) runs its 2 steps as one job of 2
  ranks; ``T`` resumes at step 2 and ``L`` at step 3 (worker 1 from Ray's copy); both finish
  at step 6.

``jax_cases`` (``JaxTrainer``, 2 workers on CPU): the golden ``accumix launch`` job's strategies
(2 processes of 2 devices), then the JAX example's loop ``J`` with a shared run directory:
its reference without saves; ``J`` until its save at step 2, the run directory deleted and
worker 1 raising; attempt 1: ``J`` resumes from Ray's copy and finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import ray.train
import ray.train.collective
from examples import ray_train as example

# The default recipe, shrunk to a second: 1 layer, 4 files, 2 steps, a checkpoint at the end.
RECIPE = ["max_steps=2", "checkpoint_every=2", "eval_every=null", "model.n_layer=1",
          "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_files=4",
          "data.max_val_bytes=500", "sample.max_new_tokens=0", "global_batch_size=8",
          "micro_batch_size=2", "plot=false", "progress_bar=false", "loggers=[csv]"]


class _Stop(Exception):
    """Ends a job where the case wants it to end, on every worker alike."""


def _attempt(out: Path, rank: int) -> int:
    """This attempt's number, the same on every worker (rank 0 counts, Ray broadcasts)."""
    number = None
    if rank == 0:
        number = len(list(out.glob("attempt-*")))
        (out / f"attempt-{number}").touch()
    return ray.train.collective.broadcast_from_rank_zero(number)


def _write(out: Path, attempt: int, rank: int, facts: dict[str, Any]) -> None:
    path = out / f"a{attempt}-r{rank}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **facts}))


def _registered() -> str | None:
    checkpoint = ray.train.get_checkpoint()
    return os.path.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None


def torch_cases(config: dict[str, Any]) -> None:
    import accumix as ax
    from accumix.common.run_dir import LATEST

    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    attempt = _attempt(out, rank)
    facts: dict[str, Any] = {"registered_at_start": _registered()}
    node_dir = out / "L" / f"node-{rank}"  # each worker its own disk
    facts["L_dir_existed"] = node_dir.exists()

    def record(**more: Any) -> None:
        facts.update(more)
        _write(out, attempt, rank, facts)

    original_save, original_load = ax.Accelerator.save_state, ax.Accelerator.load_state
    job = {"name": ""}

    def load(self: ax.Accelerator, path: Any, **kwargs: Any) -> Path:
        loaded = original_load(self, path, **kwargs)
        record(**{f"{job['name']}_resumed": [self.optimizer_steps, str(loaded)]})
        return loaded

    def save(self: ax.Accelerator, run_dir: Any, *args: Any, **kwargs: Any) -> Path:
        if job["name"] == "T":
            kwargs["checkpoint_upload_mode"] = "async"
        saved = original_save(self, run_dir, *args, **kwargs)
        step = self.optimizer_steps
        if job["name"] == "T":
            record(T_saves=[*facts.get("T_saves", []), step])
        if job["name"] == "T" and attempt == 0 and step == 2:
            ray.train.get_all_reported_checkpoints(  # Ray holds the ASYNC uploads
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
            pointer = Path(run_dir) / LATEST
            latest = Path(run_dir) / pointer.read_text().strip() if pointer.is_file() else None
            record(T_async_latest=latest and [latest.name, (latest / "meta.json").is_file()],
                   T_links_left=sorted(p.name for p in Path(run_dir).glob(".ray-*")))
            raise _Stop  # T is cut off here, on every worker
        if job["name"] == "L" and attempt == 0 and step == 3 and rank == 1:
            shutil.rmtree(node_dir)  # the node and its disk are gone, right after the save
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    ax.Accelerator.save_state, ax.Accelerator.load_state = save, load  # type: ignore[method-assign]
    try:
        if attempt == 0:
            acc = ax.Accelerator(strategy="ddp")
            import torch.distributed as dist

            record(launch=[acc.launch.launcher, acc.launch.world_size, acc.launch.num_nodes,
                           acc.launch.local_rank, acc.rank, acc.launch.master_addr],
                   device=str(acc.device), group_by_ray=dist.is_initialized())
            for strategy in ("ddp", "fsdp"):
                job["name"] = f"ref-{strategy}"
                example.train_loop({"strategy": strategy, "save_every": None,
                                    "run_dir": str(out / f"ref-{strategy}" / f"node-{rank}")})
        if attempt == 1:  # `accumix train` (the default recipe, shrunk) in the same workers
            from accumix.cli.main import main

            job["name"] = "R"
            record(R_exit=main(["train", *RECIPE, f"output_dir={out / 'R' / f'node-{rank}'}"]))
        job["name"] = "T"
        try:
            _trainer(out, rank, attempt)
        except _Stop:
            pass
        job["name"] = "L"
        example.train_loop({"strategy": "ddp", "save_every": 1, "run_dir": str(node_dir)})
    finally:
        ax.Accelerator.save_state, ax.Accelerator.load_state = original_save, original_load


def _trainer(out: Path, rank: int, attempt: int) -> None:
    """The Trainer on the example's model, data and batch sizes, 6 steps, a checkpoint every
    2 steps into a run directory per worker; Ray's pre-emption notice comes (to rank 0, whose
    notice Ray broadcasts) during step 1 of attempt 0; the final parameters to the facts."""
    import torch
    from ray.train.v2._internal.execution.context import get_train_context
    from ray.train.v2.api.preemption import PreemptionInfo
    from torch import nn
    from torch.utils.data import DataLoader

    import accumix as ax
    from accumix.trainer import Callback, Trainer

    class Notice(Callback):
        def on_optimizer_step(self, trainer: Trainer, metrics: Any) -> None:
            if attempt == 0 and trainer.step == 1 and rank == 0:  # what Ray's watcher does
                get_train_context().preemption_context.preemption_info = PreemptionInfo(
                    deadline_ms=None, preempted_node_to_ranks={"node-0": [0, 1]})

    acc = ax.Accelerator(strategy="ddp", precision="fp32", global_batch_size=16,
                         micro_batch_size=2, seed=0)
    model = example.make_model()
    trainer = Trainer(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        train_loader=DataLoader(example.make_data(), batch_size=2), accelerator=acc,
        step_fn=lambda m, batch: nn.functional.mse_loss(m(batch[0]), batch[1]),
        max_steps=6, checkpoint_every=2, loggers=[], run_dir=out / "T" / f"node-{rank}",
        grad_clip=None, progress_bar=False, system_metrics_every=None, callbacks=[Notice()])
    result = trainer.fit()
    params = [p.detach().flatten().tolist() for p in acc.unwrap(trainer.model).parameters()]
    _write(out, attempt, rank, {"T_done": [result.step, str(result.resumed_from)],
                                "T_params": params})


def jax_cases(config: dict[str, Any]) -> None:
    import jax
    import optax
    from examples import ray_train_jax as jax_example

    import accumix.jax as axj
    from tests import jax_workloads as w

    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    attempt = _attempt(out, rank)
    run_dir = out / "J"  # shared by the workers (orbax writes one directory from all of them)
    facts: dict[str, Any] = {}
    original_save, original_load = axj.Accelerator.save_state, axj.Accelerator.load_state

    def load(self: axj.Accelerator, path: Any, state: Any) -> Any:
        loaded = original_load(self, path, state)
        facts["J_resumed"] = int(loaded.step)
        return loaded

    def save(self: axj.Accelerator, where: Any, state: Any, *args: Any, **kwargs: Any) -> Path:
        saved = original_save(self, where, state, *args, **kwargs)
        if Path(where) == run_dir and attempt == 0 and int(state.step) == 2:
            ray.train.collective.barrier()
            if rank == 0:
                shutil.rmtree(run_dir)  # every node's copy lost
            ray.train.collective.barrier()
            _write(out, attempt, rank, facts)
            if rank == 1:
                raise RuntimeError("worker 1 fails after the save of step 2")
        return saved

    axj.Accelerator.save_state, axj.Accelerator.load_state = save, load  # type: ignore[method-assign]
    try:
        if attempt == 0:
            acc = axj.Accelerator(strategy="ddp", precision="fp32", grad_accum_steps=4)
            facts["launch"] = [acc.launch.launcher, acc.world_size, jax.process_index(),
                               jax.process_count(), acc.num_devices]
            _write(out, attempt, rank, facts)
            # accumix launch's job (tests/scripts/jax_train.py, golden params): process 0 gives
            # 4 micro-batches and process 1 gives 3, then both 4; item mode, SGD.
            batches = w.micro_batches(15, rows=4, seed=17)
            windows = ([batches[:4], batches[7:11]] if rank == 0 else
                       [batches[4:7], batches[11:]])
            for name in ("ddp", "fsdp"):
                acc = axj.Accelerator(strategy=name, precision="fp32", grad_accum_steps=4)
                state = acc.setup(w.init_params(), optax.sgd(0.5))
                step = acc.train_step(w.item_loss)
                for window in windows:
                    state, _ = step(state, window)
                gathered = jax.tree.map(
                    lambda x: jax.experimental.multihost_utils.process_allgather(x, tiled=True),
                    state.params)
                facts[f"golden_{name}"] = {
                    jax.tree_util.keystr(k): v.tolist()
                    for k, v in jax.tree_util.tree_flatten_with_path(gathered)[0]}
            _write(out, attempt, rank, facts)
            jax_example.train_loop({"save_every": None, "run_dir": str(out / "J-ref")})
        jax_example.train_loop({"save_every": 1, "run_dir": str(run_dir)})
        _write(out, attempt, rank, facts)
    finally:
        axj.Accelerator.save_state, axj.Accelerator.load_state = original_save, original_load
