"""A small byte-level GPT (nanoGPT's shape) in plain PyTorch.

The model knows nothing about accumix: parallelism and precision are applied to it from the
outside. Two details exist for the rest of the library:

* the repeated layer is its own ``nn.Module`` class, :class:`Block`, held in ``GPT.blocks`` (an
  ``nn.ModuleList``), so FSDP wrapping can find the repeated class without being told;
* ``forward(idx, labels)`` returns ``(loss_sum, num_items)``, the summed token loss and the count
  of real tokens, for ``Accelerator.backward(loss_sum, num_items=n)``: averaging per micro-batch
  would bias the loss when documents have different lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
MAX_LAYERS = 10_000
MAX_PARAMETERS = 10**15


@dataclass(kw_only=True, frozen=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: token ids are bytes, so 256; padded inputs use 0 and padded labels
            ``-100``, so no extra pad token is needed.
        block_size: longest sequence (context length) the position table covers.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: dropout on embeddings, attention weights and residual branches.
        bias: whether Linear and LayerNorm layers carry a bias.
        tie_weights: share the output projection with the token embedding.
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        # Sane sizes: building (even on the meta device) loops over the layers, so a mistyped
        # count never returned; no model is near either bound.
        if self.n_layer > MAX_LAYERS:
            raise ValueError(f"GPTConfig.n_layer must be <= {MAX_LAYERS:,}, got {self.n_layer}")
        if self.num_parameters() > MAX_PARAMETERS:
            raise ValueError(f"GPTConfig gives {self.num_parameters():.3g} parameters, more "
                             f"than {MAX_PARAMETERS:.0e}: make n_layer, n_embd or block_size "
                             f"smaller (block_size={self.block_size}, n_embd={self.n_embd})")

    def num_parameters(self) -> int:
        """The parameters a :class:`GPT` of this shape holds (a tied weight once), counted
        without building it (``GPT.num_parameters(non_embedding=False)``)."""
        e, bias = self.n_embd, int(self.bias)
        # A block: attention (3E + E wide) and the MLP (4E, back to E): 12 E^2 weights; two
        # LayerNorm weights; biases of the four Linears (3E + E + 4E + E) and two LayerNorms.
        block = 12 * e * e + 2 * e + bias * 11 * e
        head = 0 if self.tie_weights else self.vocab_size * e
        return ((self.vocab_size + self.block_size) * e + self.n_layer * block
                + e * (1 + bias) + head)

    @classmethod
    def gpt2_small(cls, *, block_size: int = 1024, dropout: float = 0.0) -> GPTConfig:
        """GPT-2 small's shape (12 layers, 12 heads, width 768) at byte vocabulary.

        With 256 byte tokens instead of GPT-2's 50257 the embedding is tiny, so the model has
        about 85M non-embedding parameters (85,252,608 with the tied output head counted, as
        nanoGPT counts it) against GPT-2's 124M total.

        Args:
            block_size: context length; GPT-2's is 1024.
            dropout: dropout probability.

        Returns:
            The configuration.
        """
        return cls(block_size=block_size, n_layer=12, n_head=12, n_embd=768, dropout=dropout)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        # (B, T, C) -> (B, nh, T, hs): SDPA wants heads before time.
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over byte tokens.

    Args:
        config: the model's shape; defaults to ``GPTConfig()`` (about 3.2M parameters).
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config if config is not None else GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One Parameter object in two modules: state_dict has both keys, parameters() one.
            self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so shrink their output
        # projections by 1/sqrt(2 * n_layer) to keep the residual stream's variance flat.
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the model.

        Args:
            idx: token ids, ``LongTensor[B, T]`` with ``T <= block_size``.
            labels: next-token targets, ``LongTensor[B, T]``; ``-100`` marks positions without
                a target (padding). None to get logits.

        Returns:
            ``logits[B, T, vocab_size]`` when ``labels`` is None; otherwise ``(loss_sum,
            num_items)``: the float32 cross-entropy summed over labelled positions and the number
            of those positions, both 0-d tensors on the model's device (no host sync).

        Raises:
            ValueError: the sequence is longer than ``block_size``.
        """
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        # float32 even under bf16/fp16 autocast: a sum over thousands of tokens in half
        # precision loses the small per-token terms.
        loss_sum = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        num_items = (labels != IGNORE_INDEX).sum()
        return loss_sum, num_items

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Count parameters (a tied weight once).

        Args:
            non_embedding: leave out the position table, and the token table unless it is tied
                to the output head (then it counts as the head, as in nanoGPT).

        Returns:
            The number of scalar parameters.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wpe.weight.numel()
            if not self.config.tie_weights:
                total -= self.wte.weight.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token, nanoGPT's estimate (PaLM paper, appendix B) for MFU.

        ``6 * N`` for the forward and backward matmuls over the ``N`` non-embedding parameters,
        plus ``12 * n_layer * n_embd * block_size`` for attention's score and value products at
        full context. Padding and shorter sequences are not discounted.

        Returns:
            FLOPs per trained token; multiply by tokens per second and divide by peak FLOP/s.
        """
        cfg = self.config
        return 6 * self.num_parameters() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample a continuation, one token at a time.

        Args:
            idx: prompt ids, ``LongTensor[B, T]``; only the last ``block_size`` are seen.
            max_new_tokens: how many tokens to append.
            temperature: logits are divided by it; ``<= 0`` picks the most likely token.
            top_k: sample only among the ``top_k`` most likely tokens; None for all.
            generator: random source for sampling, for reproducible output.

        Returns:
            ``LongTensor[B, T + max_new_tokens]``: the prompt followed by the new tokens.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
