"""A small ResNet: BatchNorm everywhere, residual blocks with strided projections.

``build()`` returns ``(model, args)``: a batch of 32 RGB images at 64x64 and their labels; the
model returns the cross-entropy loss.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), blocks_per_stage: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, c_in = [], widths[0]
        for stage, width in enumerate(widths):
            for b in range(blocks_per_stage):
                layers.append(BasicBlock(c_in, width, stride=2 if stage > 0 and b == 0 else 1))
                c_in = width
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        logits = self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
        return F.cross_entropy(logits, labels)


def build(batch: int = 32, size: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return ResNet(), (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))
