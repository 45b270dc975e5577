"""What a solver kernel returns: the regions it chose (and the nodes it rematerialises), the
simulator's report of them, and where they came from. ``solvers.orchestrate`` turns the one a
solve ends with into a ``Plan``; kernels never build plans, read clocks for them, or format
budgets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.region import Region
from ckptplan.remat import indices
from ckptplan.simulation import Report, simulate

Status = Literal["optimal", "feasible", "infeasible", "timeout"]  # ``plan.SolverStatus``


@dataclass(frozen=True)
class Solution:
    """``regions`` and ``remat`` (node names, ``ckptplan.remat``) for one graph, with ``report``,
    what ``simulate`` says of them there. ``solver``: the kernel that made them; ``status``,
    ``gap`` and ``note`` as a plan's ``SolverInfo`` records them; ``origin``: the phase or warm
    start that made the regions, when that is not ``solver`` itself; ``skipped``: the solvers
    the solve left out on this graph and why, which the plan's note ends with
    (``orchestrate.plan_of``), so that no later phase's note drops them."""

    regions: tuple[Region, ...]
    report: Report
    solver: str
    status: Status = "feasible"
    note: str = ""
    gap: float | None = None
    origin: str | None = None
    remat: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.report.peak_bytes

    @property
    def cost_seconds(self) -> float:
        """What the plan adds to a step, the quantity solvers minimise."""
        return self.report.cost_seconds

    def but(self, **changes: object) -> Solution:
        """This solution with ``changes`` to its provenance (``status``, ``note``, ...)."""
        return replace(self, **changes)

    def resimulated(
        self, graph: ComputeGraph, regions: Sequence[Region], remat: Sequence[str] = (), **changes: object
    ) -> Solution:
        """``regions`` rematerialising ``remat`` (node names) on ``graph``, simulated there, with
        this solution's provenance and ``changes`` to it."""
        names = _remat_names(graph, remat)
        regions = tuple(regions)
        return replace(self, regions=regions, remat=names, report=simulate(graph, regions, remat=names), **changes)


def solution(
    graph: ComputeGraph,
    regions: Sequence[Region],
    solver: str,
    *,
    status: Status = "feasible",
    note: str = "",
    gap: float | None = None,
    origin: str | None = None,
    remat: Sequence[str] = (),
    report: Report | None = None,
) -> Solution:
    """A ``Solution`` of ``regions`` on ``graph``, simulated unless ``report`` (of the same
    regions and remat) is given. ``remat`` names nodes; it is kept in execution order."""
    names = _remat_names(graph, remat)
    regions = tuple(regions)
    return Solution(
        regions=regions,
        report=report if report is not None else simulate(graph, regions, remat=names),
        solver=solver, status=status, note=note, gap=gap, origin=origin, remat=names,
    )


def _remat_names(graph: ComputeGraph, remat: Sequence[str]) -> tuple[str, ...]:
    """``remat`` checked against ``graph`` and put in execution order (``remat.indices``)."""
    return tuple(graph.nodes[i].name for i in indices(graph, remat)) if remat else ()


def as_solution(graph: ComputeGraph, found: object) -> Solution:
    """A kernel's answer as a ``Solution``: a solver a user ``register``s may return a ``Plan``
    (anything with ``regions``, ``remat`` and a ``solver`` record), which is read and simulated."""
    if isinstance(found, Solution):
        return found
    info = found.solver
    return solution(graph, found.regions, info.name, status=info.status, note=info.note, gap=info.gap,
                    origin=info.origin, remat=found.remat)


def run_kernel(kernel: Callable[..., object], graph: ComputeGraph, budget_bytes: int, ctx: object) -> Solution:
    """``kernel``'s answer for ``graph`` within ``budget_bytes`` as a ``Solution``, and the least
    plan its ``InfeasibleBudgetError`` names likewise (``as_solution``)."""
    try:
        return as_solution(graph, kernel(graph, budget_bytes, ctx))
    except InfeasibleBudgetError as exc:
        if exc.least_plan is None or isinstance(exc.least_plan, Solution):
            raise
        raise InfeasibleBudgetError(str(exc), budget_bytes=exc.budget_bytes, min_peak_bytes=exc.min_peak_bytes,
                                    least_plan=as_solution(graph, exc.least_plan)) from None
