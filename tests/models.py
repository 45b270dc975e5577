"""Small torch models for tests: each exercises one thing the emitter must preserve."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def mlp(depth: int = 6, width: int = 64) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def norm_mlp(dropout: float = 0.0, *, blocks: int = 4, width: int = 64, hidden: int = 256) -> nn.Sequential:
    """Pre-norm MLP blocks (layer norm, up-projection, GELU, dropout, down-projection), seeded:
    the compiled-step tests' model."""
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout),
                      nn.Linear(hidden, width))
        for _ in range(blocks)
    ])


class DropoutEverywhere(nn.Module):
    """Dropout after every op: recomputation must reproduce every mask."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(F.gelu(self.drop(layer(x))))
        return x


class ConvBN(nn.Module):
    """BatchNorm in every block: running statistics must update exactly once per step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(4)]
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


class InplaceAndViews(nn.Module):
    """In-place activations, views, a frozen layer and a non-persistent buffer."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.full((width,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.a(x), inplace=True)
        h = h.view(h.shape[0], -1, 2).transpose(1, 2).reshape(h.shape[0], -1)
        h = h + self.frozen(h)
        h = self.b(h) * self.scale
        return h.t().contiguous().t()


class ScopedBlocks(nn.Module):
    """Code under ``torch.autocast(enabled=False)`` (as ``transformers``' rotary embeddings run it)
    and under ``torch.no_grad()``: ``torch.export`` turns each block into a higher-order op whose
    body is a submodule of the traced module only (``wrap_with_autocast(submod_1, ...)``)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.autocast(x.device.type, enabled=False):
            angles = torch.sin(h.float() * 0.5)
        with torch.no_grad():
            scale = h.abs().amax() + 1.0
        return self.b(h * angles.to(h.dtype)) / scale


@dataclass
class Output:
    loss: torch.Tensor
    hidden: torch.Tensor


torch.utils._pytree.register_dataclass(Output)


class KwargsAndDataclass(nn.Module):
    """Tied weights, a keyword argument, and a dataclass output with a loss field."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, *, targets: torch.Tensor, temperature: float = 1.0) -> Output:
        hidden = torch.tanh(self.mix(self.embed(ids)))
        logits = self.out(hidden) / temperature
        return Output(loss=F.cross_entropy(logits.flatten(0, 1), targets.flatten()), hidden=hidden)


class ResidualDropout(nn.Module):
    """Pre-norm residual blocks whose branch ends in dropout, as a transformer's MLP does: the
    residual stream after the first block is computed from dropout draws."""

    def __init__(self, width: int = 64, depth: int = 8, hidden: int = 64) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.ups = nn.ModuleList(nn.Linear(width, hidden) for _ in range(depth))
        self.downs = nn.ModuleList(nn.Linear(hidden, width) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs, strict=True):
            x = x + self.drop(down(F.gelu(up(norm(x)))))
        return x
