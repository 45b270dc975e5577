"""Measure a real training step's peak memory as the device's allocator counts it (CPU:
``torch.profiler``'s memory events; CUDA: ``torch.cuda.max_memory_allocated``), or tensor by
tensor with PyTorch's ``MemTracker``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import nn

from ckptplan.profiler import allocator
from ckptplan.profiler.loss import training_loss
from ckptplan.profiler.trace import model_device_type

Counter = Literal["allocator", "tensors"]


@dataclass(frozen=True)
class Measurement:
    """Peak bytes of one forward+backward step, with the module's state and inputs, and the loss."""

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
    module: nn.Module, args: Any, kwargs: dict[str, Any] | None = None, *, autocast: torch.dtype | None = None,
    counter: Counter = "allocator",
    outputs_live: bool = True,
) -> Measurement:
    """Run one training step (forward, ``training_loss``, backward) and return its peak.

    ``counter="allocator"`` (the default) counts what the allocator hands out during the step
    (kernel temporaries included), above what was allocated before it, plus the module's
    parameters, buffers and inputs, which a plan's budget counts (other state made before the
    step, such as optimizer state or DDP's gradient buckets, is not in it); ``"tensors"`` is
    ``MemTracker``'s live tensors, for a breakdown by category (it sees no kernel temporaries,
    and its hooks make autograd add gradients at branch points out of place).
    Gradients are reset to None first, as ``optimizer.zero_grad()`` does by default, so the step
    starts from the state a training loop sees. ``autocast``: run forward and loss under
    ``torch.autocast`` with this dtype and backward outside it (``forward_autocast``).
    ``outputs_live`` (the default): keep the module's outputs until backward is done, as a loop
    that holds ``out`` does (``profile``'s default too); False: drop them once the loss is made.
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    for p in module.parameters():
        p.grad = None
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outcome: dict[str, float] = {}

    def step() -> None:
        with forward_autocast(module, args, kwargs, autocast):
            out = module(*args, **kwargs)
            loss = training_loss(out)
        held = out if outputs_live else None
        del out
        loss.backward()
        del held
        outcome["loss"] = float(loss.detach())

    if counter == "tensors":
        tracker = memory_tracker(module, *inputs)
        with tracker:
            step()
        peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    elif counter == "allocator":
        peak = allocator_peak(step, model_device_type(module, inputs)) + own_bytes(module, inputs)
    else:
        raise ValueError(f"counter must be 'allocator' or 'tensors', not {counter!r}")
    return Measurement(peak_bytes=int(peak), loss=outcome["loss"])


def allocator_peak(run: Any, device_type: str) -> int:
    """The most bytes the allocator held during ``run()`` beyond what it held before."""
    if device_type != "cuda":
        return allocator.peak_bytes(run)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def own_bytes(module: nn.Module, inputs: list[torch.Tensor]) -> int:
    """Bytes of the storages of ``module``'s parameters and buffers and of ``inputs``, each once."""
    tensors = [*module.parameters(), *module.buffers(), *inputs]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


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
