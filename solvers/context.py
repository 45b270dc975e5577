"""What every solver kernel runs under: the time it was asked to take, the moment it must be done
by, and the flag Ctrl-C sets.

``solvers.solve`` makes one ``SolveContext`` per solve and hands it down; nothing else reads a
clock to decide when to stop, and no solver keeps state between calls beyond the graph's memo of
work that depends on the graph alone (``solvers.memo``: ``dp``'s chains and curves, ``sqrt``'s
candidates), which gives every call the same answers. Two readings of time, on purpose:

* ``limit``, the seconds *asked for*, sizes work that must not depend on the machine's speed or
  load: CP-SAT's deterministic clock, counts of refinement moves, shares of a search. Same graph,
  budget and limit, same plan.
* ``deadline``, a ``time.perf_counter()`` value, is the wall clock's backstop: a phase that would
  run past it stops early with the best plan it has, so the solve returns on time.

A phase given a share of the time gets ``within(seconds)``: its own ``limit``, a deadline no
later than its parent's, the same cancel flag; one that may use whatever its parent leaves gets
``sized(seconds)``, its parent's deadline. A phase whose answer is promised across runs (the
least peak an error states, which the next solve at that budget must reach again) gets
``promised(seconds)``: its own ``limit`` and the whole solve's deadline (``end``), so that a
share's wall clock on a loaded machine does not cut its deterministic clock short.

Phases say what they are doing through ``report``: the phase, a plan they found, a bound they
proved. The context keeps the cheapest plan and highest bound reported by any phase of the solve
(``Progress``) and hands that to the caller's ``on_progress`` (the CLI's status line), if any.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Progress:
    """Where a solve stands: the phase running, and the cheapest plan (its predicted recompute and
    checkpoint seconds, and peak) and highest lower bound on that cost reported so far (None
    until some phase reports one)."""

    phase: str
    best_cost_seconds: float | None = None
    best_peak_bytes: int | None = None
    bound_cost_seconds: float | None = None


@dataclass
class _Board:
    """The one mutable record a solve's contexts share: the latest ``Progress`` and who hears it."""

    listener: Callable[[Progress], None] | None = None
    progress: Progress = field(default_factory=lambda: Progress(phase="starting"))
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class SolveContext:
    limit: float
    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)
    board: _Board = field(default_factory=_Board, compare=False, repr=False)
    scored: bool = True  # its plans and bounds are the solve's own (not a sub-graph's or a changed graph's)
    started: float = field(default_factory=time.perf_counter, compare=False)  # when this phase began
    end: float | None = None  # the whole solve's deadline, which every phase inherits (None: ``deadline``)

    @classmethod
    def limited(
        cls, seconds: float | None, default: float = math.inf, on_progress: Callable[[Progress], None] | None = None
    ) -> SolveContext:
        """A fresh context of ``seconds`` (None: ``default``; ``math.inf``: no wall-clock end) whose
        phases' reports go to ``on_progress``."""
        limit = default if seconds is None else max(0.0, float(seconds))
        deadline = time.perf_counter() + limit
        return cls(limit=limit, deadline=deadline, board=_Board(listener=on_progress), end=deadline)

    def within(self, seconds: float) -> SolveContext:
        """A phase of at most ``seconds``, ending no later than this context."""
        seconds = max(0.0, seconds)
        now = time.perf_counter()
        return replace(self, limit=seconds, deadline=min(self.deadline, now + seconds), started=now)

    def before(self, seconds: float) -> SolveContext:
        """This context ending ``seconds`` before its deadline (time kept for a later phase)."""
        return replace(self, deadline=self.deadline - max(0.0, seconds))

    def sized(self, seconds: float) -> SolveContext:
        """A phase sized for ``seconds`` (its ``limit``) that may run until this context's deadline."""
        return replace(self, limit=max(0.0, seconds))

    def promised(self, seconds: float) -> SolveContext:
        """A phase sized for ``seconds`` (its ``limit``, which sizes its deterministic clock) that
        may run until the whole solve's deadline: for answers a later solve must find again."""
        end = self.deadline if self.end is None else max(self.deadline, self.end)
        return replace(self, limit=max(0.0, seconds), deadline=end)

    def unscored(self) -> SolveContext:
        """This context for work on another graph (a block, the graph with ops rematerialised),
        whose costs and bounds are not the solve's: its reports name the phase only."""
        return replace(self, scored=False)

    def report(
        self, phase: str | None = None, *, cost_seconds: float | None = None, peak_bytes: int | None = None,
        bound_cost_seconds: float | None = None,
    ) -> Progress:
        """Record that ``phase`` (None: the same phase) is running, found a plan of ``cost_seconds``
        and ``peak_bytes``, or proved ``bound_cost_seconds``; the listener hears the solve's
        standing, which keeps the cheapest plan and the highest bound."""
        board = self.board
        if not self.scored:
            cost_seconds = bound_cost_seconds = None
        with board.lock:
            now = board.progress
            if phase is not None:
                now = replace(now, phase=phase)
            if cost_seconds is not None and (now.best_cost_seconds is None or cost_seconds < now.best_cost_seconds):
                now = replace(now, best_cost_seconds=cost_seconds, best_peak_bytes=peak_bytes)
            if bound_cost_seconds is not None and (
                now.bound_cost_seconds is None or bound_cost_seconds > now.bound_cost_seconds
            ):
                now = replace(now, bound_cost_seconds=bound_cost_seconds)
            board.progress = now
        if board.listener is not None:
            board.listener(now)
        return now

    def elapsed(self) -> float:
        """Wall-clock seconds since this context (or phase) began."""
        return time.perf_counter() - self.started

    def left(self) -> float:
        """Wall-clock seconds until the deadline (0 when past it)."""
        return max(0.0, self.deadline - time.perf_counter())

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def over(self) -> bool:
        """Cancelled, or out of time."""
        return self.cancel.is_set() or time.perf_counter() >= self.deadline
