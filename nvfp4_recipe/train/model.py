"""A small decoder-only transformer in plain torch.nn (pre-norm, RMSNorm, causal SDPA, GELU MLP),
optionally with mixture-of-experts feed-forward layers (top-k routing to SwiGLU experts).

Every ``nn.Linear`` has in/out features that are multiples of 16, so ``quantize_`` can swap all of
them; the output projection is named ``lm_head`` so that recipes can keep it in high precision.
The experts are a :class:`GroupedExperts` in torchtitan's layout, which ``quantize_`` converts to
``moe.NVFP4GroupedExperts``; the router (``router``, one logit per expert) stays in high precision.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


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


class GroupedExperts(nn.Module):
    """SwiGLU experts in torchtitan's ``GroupedExperts`` layout: w1, w3 (E, hidden, dim), w2
    (E, dim, hidden); ``forward(x, num_tokens_per_expert)`` on tokens sorted by expert (high
    precision: ``torch._grouped_mm`` for bf16 on a GPU, as torchtitan, else one matmul per expert;
    ``quantize_`` swaps in the grouped NVFP4 module)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        if x.is_cuda and dtype == torch.bfloat16:
            offs = torch.cumsum(num_tokens_per_expert, 0, dtype=torch.int32)
            mm = lambda a, w: torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=offs)
            x = x.to(dtype)
            return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)
        outs = []
        for e, x_e in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append(F.linear(F.silu(F.linear(x_e, self.w1[e])) * F.linear(x_e, self.w3[e]),
                                 self.w2[e]))
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-k token-choice mixture of experts (Mixtral's routing: softmax over the router's
    logits, the top k renormalized), without load balancing: (B, T, d_model) -> same shape."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.d_model, cfg.d_ff, cfg.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(x2).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        order = torch.argsort(experts.reshape(-1), stable=True)  # assignments sorted by expert
        tokens = order // self.top_k
        ids = experts.reshape(-1)
        counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount's size is data-dependent
        y = self.experts(x2[tokens], counts)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(y[: x2.shape[0]]).index_add(0, tokens, y).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Byte-level language model: token + learned position embeddings, ``n_layers`` pre-norm blocks
    (with MoE feed-forward layers when ``cfg.n_experts``), a final RMSNorm and an untied ``lm_head``.

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
        residual_std = 0.02 / (2 * cfg.n_layers) ** 0.5  # GPT-2: residual projections by depth
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            if cfg.n_experts:
                experts = block.mlp.experts
                nn.init.normal_(experts.w1, std=0.02)
                nn.init.normal_(experts.w3, std=0.02)
                nn.init.normal_(experts.w2, std=residual_std)
            else:
                nn.init.normal_(block.mlp.fc2.weight, std=residual_std)

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
