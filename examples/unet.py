"""A small U-Net (Ronneberger et al. 2015): encoder, bottleneck, decoder with skip concatenations.

Skips keep encoder activations alive across the whole network, so the graph is not a chain.
``build()`` returns ``(model, args)``; the model returns a per-pixel regression output.
"""

from __future__ import annotations

import torch
from torch import nn


def double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU(),
    )


class UNet(nn.Module):
    def __init__(self, channels: int = 3, widths: tuple[int, ...] = (16, 32, 64)) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        c_in = channels
        for width in widths:
            self.down.append(double_conv(c_in, width))
            c_in = width
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = double_conv(widths[-1], 2 * widths[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        c_in = 2 * widths[-1]
        for width in reversed(widths):
            self.up.append(nn.ConvTranspose2d(c_in, width, 2, stride=2))
            self.dec.append(double_conv(2 * width, width))
            c_in = width
        self.out = nn.Conv2d(widths[0], channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def build(batch: int = 8, size: int = 128) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return UNet(), (torch.randn(batch, 3, size, size),)
