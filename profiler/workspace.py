"""Kernel workspaces as the device's allocator counts them.

The recording runs every op on fake tensors, which see the tensors ops exchange through the
dispatcher but not what a kernel allocates for itself: a CPU convolution's unfolded input, a
cuDNN workspace. Where the model's tensors are real and on the device the plan is for, each
distinct call (op, argument shapes, layouts and dtypes, other arguments) runs once more, for
real, on fresh tensors of those shapes: its forward, then its backward alone. Each runs inside a
window over which the allocator's count is read (CPU: ``torch.profiler``'s memory events; CUDA:
``torch.cuda.max_memory_allocated``), and what it held at its peak beyond what outlives the
window (outputs and saved tensors; returned gradients) is the op's workspace. The recording
keeps the larger of its own and this one.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.profiler import record_function

from ckptplan.profiler import allocator

log = logging.getLogger(__name__)

_MARK = "ckptplan_workspace"


Runner = Callable[[tuple, dict], Any]


@dataclass(frozen=True)
class Call:
    """One node's op as the recording ran it. ``args`` and ``kwargs`` hold its (fake) tensors,
    whose shapes, strides and dtypes the real run copies; ``prepare()``, called before the run,
    gives the function that runs the op on real arguments and the trainable parameters it reads
    besides them (a module's, of a copy made then, so that the run updates no state of the
    model's, such as batch norm's statistics)."""

    name: str
    key: tuple
    prepare: Callable[[], tuple[Runner, tuple[torch.Tensor, ...]]]
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Workspace:
    fwd_bytes: int
    bwd_bytes: int


def call_key(target: Any, args: tuple, kwargs: dict) -> tuple:
    """What makes two calls allocate alike: the op and, per argument, a tensor's shape, strides
    and dtype or any other value's repr."""

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype), value.requires_grad)
        return repr(value)

    return (repr(target), tuple(describe(v) for v in pytree.tree_leaves((args, kwargs))))


def measure_workspaces(
    calls: Sequence[Call], device: torch.device, autocast: Any = None, broadcast: frozenset[str] = frozenset()
) -> dict[str, Workspace]:
    """The workspace of each call's forward and backward, by node name (calls that fail to run
    for real, in-place ones on leaves say, are left out). ``broadcast``: the nodes whose
    backward receives the loss's seed as a broadcast scalar (a summed output's gradient is
    ``ones(()).expand(...)``), which a kernel wanting a dense gradient copies; the others get a
    dense one."""
    distinct: dict[tuple, Call] = {}
    for call in calls:
        distinct.setdefault((call.key, call.name in broadcast), call)
    order = list(distinct.values())
    devices = [device] if device.type == "cuda" else []
    # The real runs draw random numbers (fresh inputs, dropout): the caller's stream is left as it was.
    with torch.random.fork_rng(devices=devices), _allocator_windows(device) as windows:
        for k, call in enumerate(order):
            _run_twice(call, k, windows, device, autocast, call.name in broadcast)
    measured = {(order[k].key, order[k].name in broadcast): ws for k, ws in windows.results().items()}
    found = {}
    for call in calls:
        ws = measured.get((call.key, call.name in broadcast))
        if ws is not None:
            found[call.name] = ws
    return found


def _run_twice(call: Call, k: int, windows: _Windows, device: torch.device, autocast: Any, broadcast: bool) -> None:
    """Forward inside window (k, "fwd"), then backward inside (k, "bwd"), its gradients taken
    with respect to the op's own tensor arguments and the parameters it reads."""
    targets: list[torch.Tensor] = []

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        t = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        if t.is_floating_point():
            t.normal_()
        else:
            t.zero_()
        if value.requires_grad and t.is_floating_point():
            # Not a leaf (an in-place op may write into it); the gradient is taken at it, so the
            # multiplication's own backward never runs.
            t = t.requires_grad_(True) * 1
            targets.append(t)
        return t

    try:
        run, params = call.prepare()
        targets.extend(params)
        args, kwargs = pytree.tree_map(real, (call.args, call.kwargs))
        forward = autocast.forward() if autocast is not None else contextlib.nullcontext()
        with windows.window(k, "fwd"), forward:
            out = run(args, kwargs)
        del args, kwargs
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not targets:
            return
        seeds = [torch.ones((), dtype=t.dtype, device=t.device).expand_as(t) if broadcast else torch.ones_like(t)
                 for t in outs]
        with windows.window(k, "bwd", returns=True) as returned:
            grads = torch.autograd.grad(outs, targets, seeds, allow_unused=True)
            returned.extend(g for g in grads if g is not None)
    except Exception as exc:  # noqa: BLE001 (any failure only leaves this call unmeasured)
        log.debug("workspace of %s not measured (%s: %s)", call.name, type(exc).__name__, exc)
        windows.forget(k)


class _Windows:
    """Named windows over one measurement, read afterwards."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fwd: dict[int, tuple[int, int]] = {}  # k -> (peak beyond the start, bytes alive past it)
        self.bwd: dict[int, tuple[int, int]] = {}  # k -> (peak beyond the start, bytes returned)
        self._failed: set[int] = set()
        self.events: Callable[[], list[Any]] | None = None  # CPU: the allocator's events, once recorded

    @contextlib.contextmanager
    def window(self, k: int, phase: str, returns: bool = False) -> Iterator[list[torch.Tensor]]:
        returned: list[torch.Tensor] = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield returned
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            end = torch.cuda.memory_allocated(self.device) - base
        else:
            with record_function(f"{_MARK}_{k}_{phase}"):
                yield returned
            peak = end = -1  # read from the profiler's events afterwards
        kept = sum(_nbytes(t) for t in returned) if returns else end
        (self.bwd if phase == "bwd" else self.fwd)[k] = (peak, kept)

    def forget(self, k: int) -> None:
        self._failed.add(k)

    def results(self) -> dict[int, Workspace]:
        if self.events is not None:
            self._read_events()
        found = {}
        for k, (peak, kept) in self.fwd.items():
            if k in self._failed:
                continue
            bwd_peak, returned = self.bwd.get(k, (0, 0))
            found[k] = Workspace(fwd_bytes=max(0, peak - max(0, kept)), bwd_bytes=max(0, bwd_peak - returned))
        return found

    def _read_events(self) -> None:
        """CPU: each window's peak and end, from the running total of the allocator's events."""
        events = self.events()
        marks = {}
        for event in events:
            name = event.name()
            if name.startswith(_MARK):
                _, _, k, phase = name.rsplit("_", 3)
                marks[(int(k), phase)] = (event.start_ns(), event.end_ns())
        stamps, totals = allocator.memory_totals(events)
        for (k, phase), (start, end) in marks.items():
            first, last = bisect.bisect_left(stamps, start), bisect.bisect_right(stamps, end)
            base = totals[first - 1] if first > 0 else 0
            inside = totals[first:last]
            peak = max([base, *inside]) - base
            table = self.bwd if phase == "bwd" else self.fwd
            kept = table.get(k, (0, 0))[1] if phase == "bwd" else (inside[-1] if inside else base) - base
            table[k] = (peak, kept)


@contextlib.contextmanager
def _allocator_windows(device: torch.device) -> Iterator[_Windows]:
    windows = _Windows(device)
    if device.type == "cuda":
        yield windows
        return
    with allocator.recording() as events:
        yield windows
    windows.events = events


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()
