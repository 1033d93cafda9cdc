"""The model train.py imports, with the interface of nanoGPT's model.py that the script uses:
GPTConfig, GPT(config) whose forward(idx, targets) returns (logits, loss), configure_optimizers and
estimate_mfu; a small GPT of ours (tied embedding and head, as nanoGPT's)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 101
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte, self.wpe = nn.Embedding(config.vocab_size, config.n_embd), nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        flops = 6 * sum(p.numel() for p in self.parameters()) * self.config.block_size * fwdbwd_per_iter
        return flops / dt / 1e12
