"""Solvers by name. A solver is a kernel ``(graph, budget_bytes, ctx) -> Solution`` over a frozen
``ComputeGraph``, run under a ``SolveContext`` (``solvers.context``); none imports torch. A
solver a user registers may return a ``Plan`` instead (``solution.as_solution`` reads it).

The built-in solvers are listed here, each with the time it takes when the caller sets no
limit, and imported when first asked for; ``register`` adds a user's solver beside them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ckptplan.errors import UnknownSolverError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan
from ckptplan.solvers import tuning
from ckptplan.solvers.solution import Solution

if TYPE_CHECKING:
    from ckptplan.solvers.context import SolveContext


class Solver(Protocol):
    def __call__(self, graph: ComputeGraph, budget_bytes: int, ctx: SolveContext) -> Solution | Plan: ...


@dataclass(frozen=True)
class _Entry:
    module: str  # where the function lives, imported on first use
    function: str
    default_seconds: float  # its time when the caller gives no limit (inf: until it is done) ...
    large_seconds: float | None = None  # ... on graphs of more than tuning.LARGE_NODES nodes, if another


_BUILTIN: dict[str, _Entry] = {
    "auto": _Entry("ckptplan.solvers.auto", "solve_auto", tuning.AUTO_SECONDS, large_seconds=tuning.AUTO_LARGE_SECONDS),
    "dp": _Entry("ckptplan.solvers.dp", "solve_dp", math.inf),
    "ilp": _Entry("ckptplan.solvers.ilp", "solve_ilp", tuning.ILP_SECONDS),
    "sqrt": _Entry("ckptplan.solvers.sqrt", "solve_sqrt", math.inf),
}
_USER: dict[str, Solver] = {}


def register(name: str) -> Callable[[Solver], Solver]:
    """Decorate ``fn`` to make it the solver ``name`` (``solve(..., solver=name)``); it runs
    until it returns when the caller gives no time limit."""

    def decorate(fn: Solver) -> Solver:
        if name in _BUILTIN or name in _USER:
            raise ValueError(f"solver {name!r} is registered twice")
        _USER[name] = fn
        return fn

    return decorate


def get_solver(name: str) -> Solver:
    entry = _BUILTIN.get(name)
    if entry is not None:
        return getattr(importlib.import_module(entry.module), entry.function)
    try:
        return _USER[name]
    except KeyError:
        known = ", ".join(available_solvers())
        raise UnknownSolverError(f"Unknown solver {name!r}; choose one of: {known}.") from None


def default_seconds(name: str, nodes: int = 0) -> float:
    """The time solver ``name`` takes on a graph of ``nodes`` nodes when the caller gives no limit."""
    entry = _BUILTIN.get(name)
    if entry is None:
        return math.inf
    large = entry.large_seconds is not None and nodes > tuning.LARGE_NODES
    return entry.large_seconds if large else entry.default_seconds


def available_solvers() -> list[str]:
    """Registered solver names, ``auto`` first."""
    return sorted({*_BUILTIN, *_USER}, key=lambda name: (name != "auto", name))
