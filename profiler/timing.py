"""Measured forward times of a traced graph's ops, for plans that run where they are profiled.

The roofline prices an op by its FLOPs and bytes; on a CPU that misses by tens of times either
way (docs/tuning.md, "Cost models"). Timing each op on the real tensors prices what recomputing
it costs on this machine. Backward is priced by the roofline's backward-to-forward ratio per op,
scaled to the measured backward of the whole step: the ratio alone misprices the step's backward
on a CPU, and with it every plan's overhead (docs/tuning.md, "Cost models").
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptplan.errors import CkptPlanError
from ckptplan.profiler.loss import training_loss
from ckptplan.profiler.trace import Autocast, training_mode

TIMING_RUNS = 3  # timed forwards after one warm-up; each op's median is kept


class _Timer(torch.fx.Interpreter):
    """Runs the graph, recording each node's wall time (device-synchronised on CUDA)."""

    def __init__(self, gm: torch.fx.GraphModule, sync: Any) -> None:
        super().__init__(gm)
        self.sync = sync
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def run_node(self, n: torch.fx.Node) -> Any:
        # ``Interpreter.run_node`` with only the op's own call timed: the interpreter's argument
        # lookups cost about as much as a small op, and the emitted module runs generated code.
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            run = getattr(self, n.op)
            self.sync()
            started = time.perf_counter()
            out = run(n.target, args, kwargs)
            self.sync()
        self.seconds[n.name].append(time.perf_counter() - started)
        return out


@dataclass(frozen=True)
class StepTimes:
    """What ``measure_op_seconds`` measured: each node's median forward seconds (by name), and
    the median seconds of the whole backward (None when nothing requires grad)."""

    op_seconds: dict[str, float]
    backward_seconds: float | None


def measure_op_seconds(
    model: nn.Module, gm: torch.fx.GraphModule, flat_inputs: list[Any], autocast: Autocast | None
) -> StepTimes:
    """Median forward seconds of each node of ``gm`` over ``TIMING_RUNS`` forwards with autograd
    recording, as a recompute runs them, and of the backward from ``training_loss`` (gradients
    returned by ``torch.autograd.grad``, so no ``.grad`` changes). The model's buffers
    (batch-norm statistics) and the global RNG are restored afterwards, so timing leaves no
    trace in training."""
    tensors = [*model.parameters(), *model.buffers(), *(x for x in flat_inputs if isinstance(x, torch.Tensor))]
    if any(t.is_meta for t in tensors):
        raise CkptPlanError("Measuring op times needs a model and inputs with real tensors, not on the meta device.")
    cuda = any(t.is_cuda for t in tensors)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = _Timer(gm, sync)
    leaves = [t for t in tensors if t.requires_grad]
    backward: list[float] = []
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    context = autocast.forward() if autocast is not None else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []), training_mode(model):
        for run in range(TIMING_RUNS + 1):
            with context, torch.enable_grad():
                loss = training_loss(timer.run(*flat_inputs))
            if leaves and loss.requires_grad:
                sync()
                started = time.perf_counter()
                torch.autograd.grad(loss, leaves, allow_unused=True)
                sync()
                backward.append(time.perf_counter() - started)
            del loss
            if run == 0:  # the warm-up pays one-time costs (allocations, kernel selection)
                timer.seconds.clear()
                backward.clear()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return StepTimes(
        op_seconds={name: statistics.median(samples) for name, samples in timer.seconds.items()},
        backward_seconds=statistics.median(backward) if backward else None,
    )
