"""solvers: ``ComputeGraph`` + budget -> ``Plan``. Pure functions over the frozen graph, registered
by name; none imports torch. ``solve`` resolves the budget and checks every claim with the
simulator."""

from __future__ import annotations

import time

from ckptplan.errors import CkptPlanError, InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import BudgetInfo, Plan
from ckptplan.simulation import simulate
from ckptplan.solvers import dp as _dp  # noqa: F401  (registers "dp")
from ckptplan.solvers import sqrt as _sqrt  # noqa: F401  (registers "sqrt")
from ckptplan.solvers.registry import available_solvers, get_solver, register
from ckptplan.units import describe_bytes, parse_budget

__all__ = ["available_solvers", "register", "solve"]


@register("auto")
def solve_auto(graph: ComputeGraph, budget_bytes: int, *, time_limit: float | None = None) -> Plan:
    """Run every other registered solver and keep the cheapest plan the simulator confirms."""
    started = time.perf_counter()
    best: Plan | None = None
    least_peak: int | None = None
    for name in available_solvers():
        if name == "auto":
            continue
        try:
            plan = get_solver(name)(graph, budget_bytes, time_limit=time_limit)
        except InfeasibleBudgetError as exc:
            least_peak = exc.min_peak_bytes if least_peak is None else min(least_peak, exc.min_peak_bytes)
            continue
        key = (plan.prediction.recompute_seconds, plan.prediction.peak_bytes)
        if best is None or key < (best.prediction.recompute_seconds, best.prediction.peak_bytes):
            best = plan
    if best is None:
        raise InfeasibleBudgetError(
            f"No solver fits the budget of {describe_bytes(budget_bytes)}; the least peak any reaches is "
            f"{describe_bytes(least_peak or 0)}. Raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=least_peak or 0,
        )
    note = f"auto chose {best.solver.name}: cheapest plan within budget. {best.solver.note}".strip()
    return best.model_copy(
        update={"solver": best.solver.model_copy(update={"note": note, "seconds": time.perf_counter() - started})}
    )


def solve(
    graph: ComputeGraph,
    budget: str | int | float = "8GB",
    solver: str = "auto",
    time_limit: float | None = None,
) -> Plan:
    """The plan ``solver`` finds for ``graph`` within ``budget`` (see ``ckptplan.units.parse_budget``).

    Raises ``InfeasibleBudgetError`` (with the least peak reached) when nothing fits.
    """
    budget_bytes = parse_budget(budget, graph.baseline_peak_bytes)
    plan = get_solver(solver)(graph, budget_bytes, time_limit=time_limit)
    report = simulate(graph, plan)
    if report.peak_bytes != plan.prediction.peak_bytes or report.peak_bytes > budget_bytes:
        raise CkptPlanError(
            f"Solver {solver!r} returned a plan the simulator does not confirm "
            f"(claimed {plan.prediction.peak_bytes} bytes, simulated {report.peak_bytes}, budget {budget_bytes}); "
            "this is a bug in ckptplan, please report it."
        )
    requested = budget if isinstance(budget, str) else repr(budget)
    return plan.model_copy(update={"budget": BudgetInfo(requested=requested, bytes=budget_bytes)})
