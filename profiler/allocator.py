"""What the CPU allocator hands out, read from ``torch.profiler``'s memory events.

CUDA has counters for this (``torch.cuda.max_memory_allocated``); the CPU allocator reports each
allocation and free to the profiler when ``profile_memory=True``, and the running sum of those
events is what it holds (``prof.events()`` does not list them; the Kineto results do).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def recording() -> Iterator[Callable[[], list[Any]]]:
    """Record the CPU allocator's events for the duration; yields a function that returns the
    Kineto events (memory events named ``"[memory]"``, with ``start_ns()`` and ``nbytes()``)
    once the block has ended. Kineto prints a line to the process's stderr as it starts and
    stops; those two moments run with stderr sent to the null device."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.start()
    try:
        yield lambda: prof.profiler.kineto_results.events()
    finally:
        with _stderr_silenced():
            prof.stop()


def memory_totals(events: list[Any]) -> tuple[list[int], list[int]]:
    """The memory events' times (ns) and the running total of bytes held after each, in order."""
    stamps, totals, running = [], [], 0
    for stamp, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        running += nbytes
        stamps.append(stamp)
        totals.append(running)
    return stamps, totals


def peak_bytes(run: Callable[[], None]) -> int:
    """The most bytes the CPU allocator held during ``run()`` beyond what it held before.

    Garbage is collected first and the collector held off during ``run()``: the allocator's
    count is of every free, and a collection in the middle of the step that frees tensors
    made before it (a compiled graph's leftovers, say) would lower the count by them."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with recording() as events:
            run()
    finally:
        if enabled:
            gc.enable()
    _, totals = memory_totals(events())
    return max([0, *totals])


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (a test runner's capture): nothing to silence
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
