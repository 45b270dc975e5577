"""Measure a real training step's peak memory with PyTorch's own MemTracker (CPU or CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ckptplan.profiler.loss import training_loss


@dataclass(frozen=True)
class Measurement:
    """Peak live bytes of one forward+backward step as MemTracker saw it, and the loss value."""

    peak_bytes: int
    loss: float


def measure_step(module: nn.Module, args: Any, kwargs: dict[str, Any] | None = None) -> Measurement:
    """Run one training step (forward, ``training_loss``, backward) and return MemTracker's peak.

    Gradients are reset to None first, as ``optimizer.zero_grad()`` does by default, so the step
    starts from the state a training loop sees.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    for p in module.parameters():
        p.grad = None
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tracker = MemTracker()
    tracker.track_external(module, *inputs)
    with tracker:
        loss = training_loss(module(*args, **kwargs))
        loss.backward()
        value = float(loss.detach())
        del loss
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = sum(v["Total"] for v in snapshot.values())
    return Measurement(peak_bytes=int(peak), loss=value)
