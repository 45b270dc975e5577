"""Solvers by name. A solver is a pure function ``(graph, budget_bytes, *, time_limit) -> Plan``
over a frozen ``ComputeGraph``; it never imports torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ckptplan.errors import UnknownSolverError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan


class Solver(Protocol):
    def __call__(self, graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None) -> Plan: ...


_SOLVERS: dict[str, Solver] = {}


def register(name: str) -> Callable[[Solver], Solver]:
    def decorate(fn: Solver) -> Solver:
        if name in _SOLVERS:
            raise ValueError(f"solver {name!r} is registered twice")
        _SOLVERS[name] = fn
        return fn

    return decorate


def get_solver(name: str) -> Solver:
    try:
        return _SOLVERS[name]
    except KeyError:
        known = ", ".join(available_solvers())
        raise UnknownSolverError(f"Unknown solver {name!r}; choose one of: {known}.") from None


def available_solvers() -> list[str]:
    """Registered solver names, ``auto`` first."""
    return sorted(_SOLVERS, key=lambda name: (name != "auto", name))
