"""What every solver kernel runs under: the time it was asked to take, the moment it must be done
by, and the flag Ctrl-C sets.

``solvers.solve`` makes one ``SolveContext`` per solve and hands it down; nothing else reads a
clock to decide when to stop, and no solver keeps state between calls. Two readings of time, on
purpose:

* ``limit``, the seconds *asked for*, sizes work that must not depend on the machine's speed or
  load: CP-SAT's deterministic clock, counts of refinement moves, shares of a search. Same graph,
  budget and limit, same plan.
* ``deadline``, a ``time.perf_counter()`` value, is the wall clock's backstop: a phase that would
  run past it stops early with the best plan it has, so the solve returns on time.

A phase given a share of the time gets ``within(seconds)``: its own ``limit``, a deadline no
later than its parent's, the same cancel flag; one that may use whatever its parent leaves gets
``sized(seconds)``, its parent's deadline.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SolveContext:
    limit: float
    deadline: float
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)

    @classmethod
    def limited(cls, seconds: float | None, default: float = math.inf) -> SolveContext:
        """A fresh context of ``seconds`` (None: ``default``; ``math.inf``: no wall-clock end)."""
        limit = default if seconds is None else max(0.0, float(seconds))
        return cls(limit=limit, deadline=time.perf_counter() + limit)

    def within(self, seconds: float) -> SolveContext:
        """A phase of at most ``seconds``, ending no later than this context."""
        seconds = max(0.0, seconds)
        return SolveContext(limit=seconds, deadline=min(self.deadline, time.perf_counter() + seconds),
                            cancel=self.cancel)

    def sized(self, seconds: float) -> SolveContext:
        """A phase sized for ``seconds`` (its ``limit``) that may run until this context's deadline."""
        return SolveContext(limit=max(0.0, seconds), deadline=self.deadline, cancel=self.cancel)

    def left(self) -> float:
        """Wall-clock seconds until the deadline (0 when past it)."""
        return max(0.0, self.deadline - time.perf_counter())

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def over(self) -> bool:
        """Cancelled, or out of time."""
        return self.cancel.is_set() or time.perf_counter() >= self.deadline
