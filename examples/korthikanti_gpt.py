"""The GPT layer Korthikanti et al. (2022) count activations for, written as theirs.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198), §4.1,
derives the bytes one transformer layer stores for backward with 16-bit activations and 1-byte
dropout masks: ``s·b·h·(34 + 5·a·s/h)``. The layer here has exactly the ops that derivation
walks through: pre-LayerNorm, one QKV projection, explicit ``softmax(QKᵀ/√d)`` attention (not
``scaled_dot_product_attention``) with dropout on the probabilities, the output projection
followed by dropout, a second LayerNorm, an MLP of width 4h with GELU and dropout, and residual
adds. Parameters and activations are bfloat16 (``model.to(torch.bfloat16)``, no autocast).
``TRAINING`` plans it for CUDA's kernels, as the paper counts: dropout keeps 1-byte masks there.

The defaults are GPT-3 175B's shape (Brown et al. 2020, Table 2.1: 96 layers, h = 12288,
a = 96, s = 2048), one sequence, built on the ``meta`` device so nothing is allocated.
``build()`` returns ``(model, args)``; the model computes its own loss.

    ckptplan profile examples/korthikanti_gpt.py
    python benchmarks/korthikanti.py
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

TRAINING = {"target": "cuda"}


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.heads, hs).transpose(1, 2)
        v = v.view(B, T, self.heads, hs).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        scores = scores.masked_fill(masked, float("-inf"))
        probs = self.attn_drop(F.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), masked)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, layers: int, hidden: int, heads: int, seq: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList([Layer(hidden, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        # One causal mask (True = masked out) shared by every layer, as Megatron passes its
        # attention mask: a buffer, so no layer stores a copy for backward.
        masked = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        self.register_buffer("masked", masked.view(1, 1, seq, seq), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        masked = self.masked[:, :, :T, :T]
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for layer in self.layers:
            x = layer(x, masked)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(
    layers: int = 96,
    hidden: int = 12288,
    heads: int = 96,
    seq: int = 2048,
    batch: int = 1,
    device: str = "meta",
    vocab: int = 50257,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(vocab, layers, hidden, heads, seq).to(torch.bfloat16)
        idx = torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))
    return model, (idx, targets)
