"""Measure a real training step's peak memory with PyTorch's own MemTracker (CPU or CUDA)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ckptplan.profiler.loss import training_loss
from ckptplan.profiler.trace import model_device_type


@dataclass(frozen=True)
class Measurement:
    """Peak live bytes of one forward+backward step as MemTracker saw it, and the loss value."""

    peak_bytes: int
    loss: float


def forward_autocast(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], autocast: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """What a step's forward and loss run under: ``torch.autocast`` with dtype ``autocast`` on
    the device of ``module``'s tensors (backward then runs outside it, as the profile of an
    autocast step has it), or nothing when ``autocast`` is None."""
    if autocast is None:
        return contextlib.nullcontext()
    device_type = model_device_type(module, pytree.tree_leaves((args, kwargs)))
    return torch.autocast(device_type=device_type, dtype=autocast)


def measure_step(
    module: nn.Module, args: Any, kwargs: dict[str, Any] | None = None, *, autocast: torch.dtype | None = None
) -> Measurement:
    """Run one training step (forward, ``training_loss``, backward) and return MemTracker's peak.

    Gradients are reset to None first, as ``optimizer.zero_grad()`` does by default, so the step
    starts from the state a training loop sees. ``autocast``: run forward and loss under
    ``torch.autocast`` with this dtype and backward outside it (``forward_autocast``).
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    for p in module.parameters():
        p.grad = None
    tracker = memory_tracker(module, *[t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    with tracker:
        with forward_autocast(module, args, kwargs, autocast):
            loss = training_loss(module(*args, **kwargs))
        loss.backward()
        value = float(loss.detach())
        del loss
    snapshot = tracker.get_tracker_snapshot("peak")
    peak = sum(v["Total"] for v in snapshot.values())
    return Measurement(peak_bytes=int(peak), loss=value)


def memory_tracker(module: nn.Module, *inputs: torch.Tensor) -> Any:
    """A ``MemTracker`` that counts ``module``'s state and ``inputs`` as resident, for a step of
    ``module`` run inside it, also when some of its parameters are frozen.

    MemTracker (torch 2.13) registers a gradient hook on each parameter of every module it sees
    run, to label gradients, and ``register_hook`` raises on a parameter that does not require
    grad. Such a parameter never gets a gradient, so a hook that does nothing stands in for one
    in MemTracker's table of them (which it empties on exit). What it counts is unchanged: every
    allocation; the hooks only name gradients."""
    from collections import OrderedDict

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.hooks import RemovableHandle

    tracker = MemTracker()
    for p in module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (RemovableHandle(OrderedDict()), RemovableHandle(OrderedDict()))
    tracker.track_external(module, *inputs)
    return tracker
