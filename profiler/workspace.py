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
import functools
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


Layout = tuple[tuple[int, ...] | None, ...]


def measure_workspaces(
    calls: Sequence[Call],
    device: torch.device,
    autocast: Any = None,
    broadcast: frozenset[str] = frozenset(),
    grad_strides: dict[str, Layout] | None = None,
) -> dict[str, Workspace]:
    """The workspace of each call's forward and backward, by node name (calls that fail to run
    for real, in-place ones on leaves say, are left out). ``grad_strides``: by node name, the
    strides of the gradient each of its outputs receives in the step (``record_graph``), which
    the backward run is given: a kernel wanting a dense gradient copies another one. Nodes not
    in it get a dense gradient, or, in ``broadcast``, the loss's seed as a broadcast scalar (a
    summed output's gradient is ``ones(()).expand(...)``)."""
    grad_strides = grad_strides or {}

    def seeds_of(call: Call) -> Layout | str:
        return grad_strides.get(call.name) or ("broadcast" if call.name in broadcast else "dense")

    distinct: dict[tuple, Call] = {}
    for call in calls:
        distinct.setdefault((call.key, seeds_of(call)), call)
    order = list(distinct.values())
    devices = [device] if device.type == "cuda" else []
    # The real runs draw random numbers (fresh inputs, dropout): the caller's stream is left as it was.
    with torch.random.fork_rng(devices=devices), _allocator_windows(device) as windows:
        for k, call in enumerate(order):
            _run_twice(call, k, windows, device, autocast, seeds_of(call))
    measured = {(order[k].key, seeds_of(order[k])): ws for k, ws in windows.results().items()}
    found = {}
    for call in calls:
        ws = measured.get((call.key, seeds_of(call)))
        if ws is not None:
            found[call.name] = ws
    return found


def _seed(t: torch.Tensor, seeds: Layout | str, position: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """The gradient of ones handed to output ``t``'s backward, and the strides it is to be laid
    out in when those are not dense: such a gradient is made only once backward starts (a hook
    on ``t`` swaps it in for a broadcast scalar), so that autograd alone holds it and frees it
    when the step would; a kernel that copies it into a dense one and lets it go then measures
    no more than the step holds."""
    if seeds == "broadcast":
        return torch.ones((), dtype=t.dtype, device=t.device).expand_as(t), None
    strides = seeds[position] if isinstance(seeds, tuple) and position < len(seeds) else None
    if strides is None or len(strides) != t.dim() or strides == torch.empty_like(t, device="meta").stride():
        return torch.ones_like(t), None
    return torch.ones((), dtype=t.dtype, device=t.device).expand_as(t), strides


def _extent(shape: torch.Size, strides: tuple[int, ...]) -> int:
    """Elements of storage a tensor of ``shape`` laid out with ``strides`` spans."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


def _laid_out(strides: tuple[int, ...], grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).fill_(1)


def _run_twice(
    call: Call, k: int, windows: _Windows, device: torch.device, autocast: Any, seeds: Layout | str
) -> None:
    """Forward inside window (k, "fwd"), then backward inside (k, "bwd"), its gradients taken
    with respect to the op's own tensor arguments and the parameters it reads, from gradients
    laid out as ``seeds`` says (``measure_workspaces``)."""
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
        grads_out, laid_out = [], 0
        for position, t in enumerate(outs):
            seed, strides = _seed(t, seeds, position)
            grads_out.append(seed)
            if strides is not None:
                t.register_hook(functools.partial(_laid_out, strides))
                laid_out += _extent(t.shape, strides) * t.element_size()
        with windows.window(k, "bwd", returns=True) as returned:
            windows.made_in_window[k] = laid_out
            grads = torch.autograd.grad(outs, targets, grads_out, allow_unused=True)
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
        # k -> bytes of the laid-out gradients made inside backward window k: the step holds
        # those before the op's backward starts, so they are not its workspace.
        self.made_in_window: dict[int, int] = {}
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
            bwd_bytes = bwd_peak - returned - self.made_in_window.get(k, 0)
            found[k] = Workspace(fwd_bytes=max(0, peak - max(0, kept)), bwd_bytes=max(0, bwd_bytes))
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
