"""The default recipe's PyTorch GPT pieces: its step function, the ``micro_batch_size=auto``
probe, AdamW with its parameter groups, loading ``init_from`` weights and the closing sample."""

from __future__ import annotations

from typing import Any

import torch

from accumix.errors import ConfigError
from accumix.recipes.gpt import GPT
from accumix.recipes.text_data import decode, encode, pad_collate
from accumix.recipes.train_config import SampleConfig, TrainConfig


def _param_groups(model: GPT, weight_decay: float) -> list[dict[str, Any]]:
    # nanoGPT's split: decay matrices (weights of Linear and Embedding), not biases or norms.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def gpt_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The recipe's step: ``(loss_sum, num_items)`` over the batch's real (unpadded) tokens."""
    return model(batch["input_ids"], labels=batch["labels"])


def choose_micro_batch(acc: Any, config: TrainConfig, model: GPT, optimizer: Any, *,
                       cache: bool = True) -> tuple[Any, Any, int]:
    """``micro_batch_size=auto``: sets up the model and optimizer and probes them with
    ``block_size``-token documents (the longest the data gives); the choice is cached in the run
    directory when ``cache``. Returns the set-up model, optimizer and the chosen micro batch."""
    trained, stepped = acc.setup(model, optimizer)
    worst = [torch.zeros(config.model.block_size + 1, dtype=torch.int64)]  # a full block
    micro = acc.find_micro_batch_size(lambda batch: gpt_step(trained, batch),
                                      lambda n: pad_collate(worst * n),
                                      run_dir=config.run_dir if cache else None)
    return trained, stepped, micro


def new_optimizer(config: TrainConfig, model: GPT) -> torch.optim.Optimizer:
    """The recipe's AdamW (learning rate scaled to the global batch when asked)."""
    opt_cfg = config.optimizer
    lr = opt_cfg.lr
    if opt_cfg.base_batch_size is not None:
        from accumix.trainer import scale_lr

        lr = scale_lr(lr, global_batch_size=config.global_batch_size,
                      base_batch_size=opt_cfg.base_batch_size, rule=opt_cfg.scale_rule)
    return torch.optim.AdamW(_param_groups(model, opt_cfg.weight_decay), lr=lr,
                             betas=opt_cfg.betas)


def load_weights(model: GPT, path: str) -> None:
    """Loads a ``model.safetensors`` of either backend into ``model`` (strict).

    Raises:
        ConfigError: the file's keys or shapes do not fit ``model`` (another model shape).
    """
    from safetensors.torch import load_file

    tensors = load_file(path)
    expected = model.state_dict()
    wrong = sorted(k for k in expected if k in tensors
                   and tuple(tensors[k].shape) != tuple(expected[k].shape))
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if wrong or missing or extra:
        detail = (f"{wrong[0]} is {tuple(tensors[wrong[0]].shape)}, this model's "
                  f"{tuple(expected[wrong[0]].shape)}" if wrong else
                  f"missing {missing[:3]}, unexpected {extra[:3]}")
        raise ConfigError(f"init_from={path!r} does not fit this GPT ({detail}); set model.* to "
                          "the shape it was trained with")
    model.load_state_dict(tensors)


@torch.no_grad()
def generate(model: torch.nn.Module, sample: SampleConfig, *, seed: int = 0) -> str:
    """Continues ``sample.prompt`` with the model (in eval mode), reproducibly."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompt = encode(sample.prompt).unsqueeze(0).to(device)
    out = model.generate(prompt, sample.max_new_tokens, temperature=sample.temperature,
                         top_k=sample.top_k, generator=torch.Generator(device).manual_seed(seed))
    model.train(was_training)
    return decode(out[0])
