"""The examples a porter from Accelerate and Fabric needs (issue 44), on 2 ranks, against the same
jobs written in plain PyTorch DDP, in the shared 2-rank spawn.

``examples/nlp_classification.py`` (Accelerate's ``complete_nlp_example.py``: accumulation,
checkpointing, tracking) runs from its command line in a child process per rank that is
SIGKILLed right after it logged epoch 1 (before that epoch's checkpoint); the rank then resumes
it from the epoch-0 checkpoint. Its weights are within 1e-6 of plain DDP (loss / K by hand, the
short last window divided by its size); its metrics files hold rank 0's rows, each epoch once
(CSV, JSONL, TensorBoard), and each epoch's evaluation counted the 131 samples once.
``examples/image_classifier.py`` (Fabric's ``train_fabric.py``) is bitwise equal to plain DDP,
and its test loss and accuracy are the one-process values.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from accumix.testing import free_port
from tests.distributed.shared_spawn import shared_result

ROOT = Path(__file__).resolve().parents[2]
# 100 samples a rank in batches of 8: windows of 3, 3, 3, 3 and 1 micro-batches an epoch (the
# last batch holds 4); 131 evaluation samples in batches of 16: the last padded with one repeat.
NLP_ARGS = ["--train-size", "200", "--batch-size", "8", "--grad-accum", "3", "--lr", "5e-2",
            "--eval-size", "131", "--eval-batch-size", "16", "--epochs", "3",
            "--warmup-steps", "2", "--checkpointing-steps", "epoch", "--with-tracking"]
IMAGE_ARGS = ["--train-size", "240", "--test-size", "131", "--batch-size", "16", "--epochs",
              "2", "--log-interval", "1000"]
# The killed attempt: the example from its command line; its TensorBoard logger (the last of
# the three) SIGKILLs the process once it has logged epoch 1, before that epoch's checkpoint.
KILLED = """
import os, runpy, signal, sys
from accumix.trainer import loggers
log = loggers.TensorBoardLogger.log
def killing_log(self, row):
    log(self, row)
    if row["step"] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
loggers.TensorBoardLogger.log = killing_log
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (``examples/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}",
                                                  ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _killed_attempt(out: Path, port: int) -> int:
    """This rank's first attempt, in a child process of its own 2-rank group; its exit code."""
    env = {**os.environ, "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", KILLED, str(ROOT / "examples" /
                                                             "nlp_classification.py"),
                           *NLP_ARGS, "--output-dir", str(out)], env=env, cwd=out.parent,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != -9:
        raise AssertionError(f"exit {done.returncode}:\n{done.stdout[-2000:]}"
                             f"{done.stderr[-3000:]}")
    return done.returncode


def nlp_reference(nlp: ModuleType) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The NLP job in plain PyTorch DDP: loss / window size by hand (K, or the short last
    window's count), no_sync off the boundary; this rank's weights and per-epoch mean losses."""
    args = nlp.parse_args(NLP_ARGS)
    _seed(args.seed)
    train = nlp.make_sentences(args.train_size, seed=1)
    evaluation = nlp.make_sentences(args.eval_size, seed=2)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    eval_loader = DataLoader(evaluation, batch_size=args.eval_batch_size,
                             sampler=DistributedSampler(evaluation, shuffle=False))
    model = nlp.Classifier()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = math.ceil(len(loader) / args.grad_accum) * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, nlp.linear_warmup(args.warmup_steps, total))
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = list(loader)
        epoch_loss = torch.zeros(())
        for start in range(0, len(batches), args.grad_accum):
            window = batches[start:start + args.grad_accum]
            for i, (tokens, mask, labels) in enumerate(window):
                last = i == len(window) - 1
                with ddp.no_sync() if not last else torch.enable_grad():
                    loss = F.cross_entropy(ddp(tokens, mask), labels)
                    (loss / len(window)).backward()
                epoch_loss += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append((epoch_loss / len(batches)).item())
        for _ in eval_loader:  # the example iterates its eval loader too (one RNG draw)
            pass
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def image_reference(image: ModuleType) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The image job in plain PyTorch DDP, and each epoch's test loss and accuracy evaluated
    in this one process over the whole test set."""
    args = image.parse_args(IMAGE_ARGS)
    _seed(args.seed)
    train = image.make_images(args.train_size, seed=1)
    test = image.make_images(args.test_size, seed=2)
    sampler = DistributedSampler(train, shuffle=False)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = image.Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    ddp = DDP(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    history = []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        ddp.train()
        for data, target in loader:
            optimizer.zero_grad()
            F.nll_loss(ddp(data), target).backward()
            optimizer.step()
        scheduler.step()
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for data, target in DataLoader(test, batch_size=args.test_size):
                output = model(data)
                loss_sum += F.nll_loss(output.double(), target, reduction="sum").item()
                correct += int((output.argmax(1) == target).sum())
        history.append({"epoch": epoch, "test_loss": loss_sum / len(test),
                        "accuracy": correct / len(test), "tested": len(test)})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


def _tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))  # applies the resumed attempt's purge
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _job(tmp: Path, port: int) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    nlp, image = example("nlp_classification"), example("image_classifier")
    out = tmp / "nlp"
    result: dict[str, Any] = {"killed": _killed_attempt(out, port)}
    resumed = nlp.main([*NLP_ARGS, "--output-dir", str(out),
                        "--resume-from-checkpoint", str(out / "checkpoints")])
    params, losses = nlp_reference(nlp)
    result["nlp"] = {
        "diff": max(float((resumed["params"][k] - params[k]).abs().max()) for k in params),
        "metrics": resumed["metrics"], "rows": resumed["rows"], "losses": losses,
        # lists: tensors through the spawn's queue would need the sender alive
        "params": {k: v.tolist() for k, v in resumed["params"].items()}}
    dist.barrier()  # rank 0 has closed its files
    if rank == 0:
        with (out / "metrics.csv").open(newline="") as f:
            result["csv"] = list(csv.DictReader(f))
        result["jsonl"] = [json.loads(line) for line in
                           (out / "metrics.jsonl").read_text().splitlines()]
        result["files"] = sorted(p.name for p in out.iterdir())
        result["event_files"] = len(list((out / "tensorboard").glob("events.out.tfevents.*")))
        result["tensorboard"] = _tensorboard_scalars(out / "tensorboard")
    trained = image.main(IMAGE_ARGS)
    reference, history = image_reference(image)
    result["image"] = {"bitwise": all(torch.equal(trained["params"][k], reference[k])
                                      for k in reference),
                       "history": trained["history"], "reference_history": history}
    return result


def shared_job(tmp: Path) -> tuple[Any, tuple[Any, ...]]:
    """This module's job, run in the spawn it shares with other modules (conftest.py)."""
    return _job, (tmp, free_port())


def test_nlp_example_resumes_after_a_kill_within_1e6_of_ddp(
        shared_spawn: dict[str, list[Any]]) -> None:
    ranks = shared_result(shared_spawn, __name__)
    for r in ranks:
        assert r["killed"] == -9
        assert r["nlp"]["diff"] < 1e-6, r["nlp"]["diff"]
        # Each epoch evaluated the 131 samples once (the set-up loader pads to 132 on 2 ranks).
        assert [m["evaluated"] for m in r["nlp"]["metrics"]] == [131, 131]  # epochs 1, 2 here
    assert ranks[0]["nlp"]["metrics"] == ranks[1]["nlp"]["metrics"]
    # The resumed run's accuracy and F1 are the one-process values from its weights.
    nlp = example("nlp_classification")
    model = nlp.Classifier()
    model.load_state_dict({k: torch.tensor(v) for k, v in ranks[0]["nlp"]["params"].items()})
    tokens, mask, labels = nlp.make_sentences(131, seed=2).tensors
    with torch.no_grad():
        accuracy, f1 = nlp.accuracy_f1(model(tokens, mask).argmax(-1), labels)
    last = ranks[0]["nlp"]["metrics"][-1]
    assert (last["accuracy"], last["f1"]) == (accuracy, f1)
    assert 0.6 < accuracy < 1 and 0.4 < f1 < 1  # it learned, and the checks can tell


def test_nlp_example_logs_rank_0s_rows_once_per_epoch_across_the_kill(
        shared_spawn: dict[str, list[Any]]) -> None:
    pytest.importorskip("tensorboard", reason="make test installs it (the tensorboard extra)")
    rank0, rank1 = shared_result(shared_spawn, __name__)
    # One file per logger, written by rank 0 alone (before: rank 1's rows overwrote rank 0's).
    assert rank0["files"] == ["checkpoints", "metrics.csv", "metrics.jsonl", "tensorboard"]
    assert rank0["event_files"] == 2  # one per attempt, both rank 0's
    csv_rows, jsonl_rows = rank0["csv"], rank0["jsonl"]
    # Each epoch once, 0-based (before: resume_step=0 read as a fresh start lost epoch 0).
    assert [row["step"] for row in csv_rows] == ["0", "1", "2"]
    assert [row["step"] for row in jsonl_rows] == [0, 1, 2]
    losses0, losses1 = rank0["nlp"]["losses"], rank1["nlp"]["losses"]
    for epoch, (row, line) in enumerate(zip(csv_rows, jsonl_rows, strict=True)):
        assert float(row["train_loss"]) == line["train_loss"]
        assert abs(line["train_loss"] - losses0[epoch]) < 1e-5  # rank 0's own mean
        assert abs(line["train_loss"] - losses1[epoch]) > 1e-3  # not rank 1's
    # The resumed attempt's rows are what it logged (the killed one's epoch 1 was dropped).
    assert jsonl_rows[1:] == rank0["nlp"]["rows"]
    board = rank0["tensorboard"]
    for tag in ("accuracy", "f1", "train_loss"):
        assert [step for step, _ in board[tag]] == [0, 1, 2], tag
        assert [pytest.approx(v, rel=1e-6) for _, v in board[tag]] == [
            line[tag] for line in jsonl_rows]


def test_image_example_is_bitwise_plain_ddp_with_exact_test_metrics(
        shared_spawn: dict[str, list[Any]]) -> None:
    for r in shared_result(shared_spawn, __name__):
        image = r["image"]
        assert image["bitwise"]
        for got, want in zip(image["history"], image["reference_history"], strict=True):
            assert (got["epoch"], got["tested"], got["accuracy"]) == (
                want["epoch"], want["tested"], want["accuracy"])
            assert abs(got["test_loss"] - want["test_loss"]) < 1e-12
        assert 0 < image["history"][-1]["accuracy"] < 1
