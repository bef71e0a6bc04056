"""A small decoder-only transformer in plain torch.nn (pre-norm, RMSNorm, causal SDPA, GELU MLP).

Every ``nn.Linear`` has in/out features that are multiples of 16, so ``quantize_`` can swap all of
them; the output projection is named ``lm_head`` so that recipes can keep it in high precision.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data import VOCAB


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`TinyLM`. ``d_model``, ``d_ff`` and ``seq_len`` must be multiples of 16 and
    ``d_model`` a multiple of ``n_heads``."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    seq_len: int
    vocab: int = VOCAB

    def validate(self) -> None:
        """Raises ValueError naming the field (as its command-line option) when a shape is invalid."""
        for name in ("d_model", "d_ff", "seq_len"):
            value = getattr(self, name)
            if value <= 0 or value % 16:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive multiple of 16 "
                                 f"(NVFP4 blocks are 16 wide), got {value}")
        if self.n_layers < 1 or self.n_heads < 1:
            raise ValueError(f"--n-layers and --n-heads must be >= 1, got {self.n_layers} and {self.n_heads}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads ({self.n_heads})")


class Attention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, d_model) -> (B, T, d_model)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Byte-level language model: token + learned position embeddings, ``n_layers`` pre-norm blocks,
    a final RMSNorm and an untied ``lm_head``.

    forward(tokens) takes int64 (B, T) with T <= seq_len and returns float logits (B, T, vocab).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)
        for block in self.blocks:  # GPT-2 style: scale the residual projections by depth
            for lin in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(lin.weight, std=0.02 / (2 * cfg.n_layers) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def count_params(model: nn.Module) -> int:
    """Number of parameters (elements) of ``model``."""
    return sum(p.numel() for p in model.parameters())
