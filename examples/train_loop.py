"""The plain loop of DESIGN.md on real text: a small byte-level GPT on the stdlib's own source.

    python examples/train_loop.py                     # one process
    torchrun --nproc-per-node 2 examples/train_loop.py   # two, unchanged

Item-weighted loss over variable-length, padded documents; accumulation to a fixed global batch.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader

import accumix as ax
from accumix.recipes import (
    GPT,
    ByteDocumentDataset,
    GPTConfig,
    decode,
    encode,
    pad_collate,
    split_files,
    stdlib_files,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--val-bytes", type=int, default=100_000, help="held-out text to score")
    args = parser.parse_args()

    acc = ax.Accelerator(precision=args.precision, global_batch_size=args.global_batch,
                         micro_batch_size=args.micro_batch, seed=0)
    config = GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=128)
    train_files, val_files = split_files(stdlib_files(max_files=200), val_fraction=0.05)
    train = ByteDocumentDataset(train_files, config.block_size, max_bytes=2_000_000)
    val = ByteDocumentDataset(val_files, config.block_size, max_bytes=args.val_bytes)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / args.steps))
    loader = DataLoader(train, batch_size=args.micro_batch, shuffle=True, collate_fn=pad_collate)
    model, optimizer, scheduler, loader = acc.setup(model, optimizer, scheduler, loader)
    acc.print(f"{acc.world_size} process(es), strategy {acc.strategy.name}, precision "
              f"{acc.policy.name}, K={acc.grad_accum_steps}, {len(train)} training documents")

    started = time.perf_counter()
    while acc.optimizer_steps < args.steps:
        for batch in loader:
            with acc.accumulate():
                loss_sum, num_items = model(batch["input_ids"], labels=batch["labels"])
                acc.backward(loss_sum, num_items=num_items)   # token-weighted, exact
                norm = acc.clip_grad_norm_(1.0)               # None off the boundary
                optimizer.step()                              # no-op off the boundary
                scheduler.step()                              # only after a real step
                optimizer.zero_grad()
            if acc.sync_gradients and acc.optimizer_steps % 10 == 0:
                # The last micro-batch's token mean over all ranks, for the log only.
                token_loss = acc.reduce(loss_sum.detach(), "sum") / acc.reduce(
                    num_items.float(), "sum")
                acc.print(f"step {acc.optimizer_steps:4d}  loss/token {token_loss.item():.3f}  "
                          f"grad norm {norm.item():.2f}  {time.perf_counter() - started:.0f}s")
            if acc.optimizer_steps >= args.steps:
                break

    model.eval()
    with torch.no_grad():
        total, count = torch.zeros(()), torch.zeros(())
        for batch in DataLoader(val, batch_size=16, collate_fn=pad_collate):
            loss_sum, num_items = acc.unwrap(model)(batch["input_ids"], labels=batch["labels"])
            total, count = total + loss_sum.float(), count + num_items
        acc.print(f"validation loss/token {(total / count).item():.3f} on {len(val)} documents")
        prompt = encode("def ").unsqueeze(0)
        sample = acc.unwrap(model).generate(prompt, 120, temperature=0.8, top_k=20,
                                            generator=torch.Generator().manual_seed(0))
        acc.print("sample:\n" + decode(sample[0]))
    acc.end()


if __name__ == "__main__":
    main()
