"""Sequence classification with gradient accumulation, checkpointing and tracking: Accelerate's
``complete_nlp_example.py`` written for accumix, with a tiny model and synthetic sentences (no
download, a few seconds on a CPU).

    python examples/nlp_classification.py --output-dir runs/nlp --with-tracking
    torchrun --nproc-per-node 2 examples/nlp_classification.py --output-dir runs/nlp \\
        --checkpointing-steps epoch --with-tracking
    torchrun --nproc-per-node 2 examples/nlp_classification.py --output-dir runs/nlp \\
        --checkpointing-steps epoch --with-tracking --resume-from-checkpoint runs/nlp/checkpoints

What differs from the Accelerate script, and why (docs/guides/migrating.md has the list):
the loss is not divided by the accumulation steps by hand (``acc.backward`` does it, and a short
last window is divided by its true size); the LR schedule counts optimizer steps (a set-up
scheduler steps once per optimizer step, Accelerate's ``num_processes`` times);
``acc.gather_for_metrics`` drops the evaluation set's padding (each sample counted once on any
number of processes); a resume continues mid-epoch at the exact batch, with nothing to skip by
hand; the loggers write from the main process only and keep one row per epoch across a resume.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accumix as ax
from accumix.trainer.loggers import tensorboard_available

VOCAB, MAX_LEN, CLASSES = 64, 16, 2


def make_sentences(count: int, seed: int) -> TensorDataset:
    """Token ids (0 pads), their mask, and a label: whether the sentence has more tokens from
    the lower half of the vocabulary than from the upper half."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, MAX_LEN + 1, (count,), generator=g)
    mask = torch.arange(MAX_LEN)[None, :] < lengths[:, None]
    tokens = torch.randint(1, VOCAB, (count, MAX_LEN), generator=g) * mask
    low = ((tokens > 0) & (tokens < VOCAB // 2)).sum(1)
    labels = (low * 2 > lengths).long()
    return TensorDataset(tokens, mask.float(), labels)


class Classifier(nn.Module):
    """Embeddings, a masked mean over the sentence, one hidden layer, two classes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=0)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pooled = (self.embed(tokens) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(torch.tanh(self.hidden(pooled)))


def linear_warmup(warmup: int, total: int) -> Any:
    """``transformers.get_linear_schedule_with_warmup``'s factor, by optimizer step."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor


def accuracy_f1(predictions: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Accuracy and the F1 of class 1 (GLUE MRPC's two metrics)."""
    tp = int(((predictions == 1) & (labels == 1)).sum())
    fp = int(((predictions == 1) & (labels == 0)).sum())
    fn = int(((predictions == 0) & (labels == 1)).sum())
    accuracy = int((predictions == labels).sum()) / len(labels)
    return accuracy, (2 * tp / (2 * tp + fp + fn) if tp else 0.0)


def training_function(args: argparse.Namespace) -> dict[str, Any]:
    """Trains, evaluates each epoch, saves and logs; returns what the tests compare."""
    acc = ax.Accelerator(precision=args.precision, grad_accum_steps=args.grad_accum,
                         seed=args.seed)
    train = DataLoader(make_sentences(args.train_size, seed=1), batch_size=args.batch_size,
                       shuffle=True)
    evaluation = DataLoader(make_sentences(args.eval_size, seed=2),
                            batch_size=args.eval_batch_size)
    train, evaluation = acc.setup(train, evaluation)  # sharded; padded to equal batches
    model = Classifier()  # after the seed: the same weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Optimizer steps: the set-up scheduler steps once per optimizer step.
    total_steps = math.ceil(len(train) / acc.grad_accum_steps) * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, linear_warmup(args.warmup_steps, total_steps))
    model, optimizer, scheduler = acc.setup(model, optimizer, scheduler)

    output = Path(args.output_dir)
    checkpoints = output / "checkpoints"
    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        acc.load_state(args.resume_from_checkpoint)  # the loader continues at its batch
        starting_epoch = train.epoch
        resume_step = starting_epoch - 1  # the checkpoint covers the rows of earlier epochs
        acc.print(f"resumed from {args.resume_from_checkpoint} at epoch {starting_epoch}, "
                  f"optimizer step {acc.optimizer_steps}")
    loggers: list[ax.MetricLogger] = []
    if args.with_tracking:  # every rank calls them; only the main process writes
        loggers = [ax.CSVLogger(), ax.JSONLLogger()]
        if tensorboard_available():  # pip install 'accumix[tensorboard]'
            loggers.append(ax.TensorBoardLogger())
        for logger in loggers:
            logger.open(output, resume_step=resume_step)

    rows, metrics = [], []
    for epoch in range(starting_epoch, args.epochs):
        model.train()
        total_loss, batches = torch.zeros(()), 0
        for tokens, mask, labels in train:
            with acc.accumulate():
                loss = nn.functional.cross_entropy(model(tokens, mask), labels)
                acc.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total_loss, batches = total_loss + loss.detach(), batches + 1
            step = args.checkpointing_steps
            if step.isdigit() and acc.sync_gradients and acc.optimizer_steps % int(step) == 0:
                acc.save_state(checkpoints)

        model.eval()
        predictions, references = [], []
        with torch.no_grad():
            for tokens, mask, labels in evaluation:
                logits = model(tokens, mask)
                # Every rank's rows, the padding repeats of the last batch dropped.
                preds, refs = acc.gather_for_metrics((logits.argmax(-1), labels))
                predictions.append(preds)
                references.append(refs)
        accuracy, f1 = accuracy_f1(torch.cat(predictions), torch.cat(references))
        metrics.append({"epoch": epoch, "accuracy": accuracy, "f1": f1,
                        "evaluated": len(torch.cat(references))})
        acc.print(f"epoch {epoch}: accuracy {accuracy:.4f} f1 {f1:.4f}")
        if args.with_tracking:
            row = {"step": epoch, "epoch": epoch, "accuracy": accuracy, "f1": f1,
                   # this process's mean over its batches, as Accelerate's example logs it
                   "train_loss": (total_loss / max(batches, 1)).item(),
                   "lr": scheduler.get_last_lr()[0]}
            rows.append(row)
            for logger in loggers:
                logger.log(row)
        if args.checkpointing_steps == "epoch":
            acc.save_state(checkpoints)

    for logger in loggers:
        logger.close()
    acc.end()
    params = {k: v.detach().clone() for k, v in acc.unwrap(model).state_dict().items()}
    return {"params": params, "rows": rows, "metrics": metrics}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32",
                        help="fp32, bf16-mixed, fp16-mixed or auto")
    parser.add_argument("--checkpointing-steps", default="",
                        help="'epoch', or save every N optimizer steps")
    parser.add_argument("--resume-from-checkpoint", default="",
                        help="a run directory (its latest step) or one step directory")
    parser.add_argument("--with-tracking", action="store_true",
                        help="metrics.csv, metrics.jsonl (and TensorBoard when installed) in "
                        "--output-dir")
    parser.add_argument("--output-dir", default="runs/nlp_classification")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--eval-size", type=int, default=408)  # MRPC's validation split
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return training_function(parse_args(argv))


if __name__ == "__main__":
    main()
