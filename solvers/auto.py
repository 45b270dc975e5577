"""Solver ``auto``: run the solvers that suit the graph and keep the cheapest plan."""

from __future__ import annotations

from collections.abc import Callable

from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.repeats import find_blocks
from ckptplan.solvers import ilp, tuning
from ckptplan.solvers.context import SolveContext
from ckptplan.solvers.edges import at_unit_edges
from ckptplan.solvers.ilp_flat import WARM_SOLVERS
from ckptplan.solvers.least import least_of
from ckptplan.solvers.registry import available_solvers, default_seconds, get_solver
from ckptplan.solvers.solution import Solution, run_kernel


def solve_auto(graph: ComputeGraph, budget_bytes: int, ctx: SolveContext | None = None) -> Solution:
    """Run the solvers that suit the graph and keep the cheapest plan the simulator confirms.

    ``sqrt`` always runs, ``dp`` too except on graphs ``ilp`` solves block by block (its chain
    DP is slow and coarse there). ``ilp`` runs on graphs of up to ``tuning.FLAT_MAX_NODES`` nodes
    and on larger ones made of repeated blocks (which it solves block by block), started from
    their plans, so it can only improve on them, until ``ctx``'s deadline (None: ``auto``'s
    default limit from now). Solvers registered by users run too. The plan records which solver
    won, and what was skipped (``Solution.skipped``). When none fits, the error states the least
    peak of a plan one of them made (``solvers.least``).
    """
    ctx = ctx if ctx is not None else SolveContext.limited(default_seconds("auto", len(graph.nodes)))
    plans: list[Solution] = []
    errors: list[InfeasibleBudgetError] = []
    skipped: list[str] = []

    def attempt(name: str, kernel: Callable[..., object]) -> None:
        ctx.report(name)
        try:
            plan = at_unit_edges(graph, run_kernel(kernel, graph, budget_bytes, ctx), budget_bytes)
        except InfeasibleBudgetError as exc:
            errors.append(exc)
        else:
            plans.append(plan)
            ctx.report(cost_seconds=plan.cost_seconds, peak_bytes=plan.peak_bytes)

    by_blocks = len(graph.nodes) > tuning.FLAT_MAX_NODES and bool(find_blocks(graph)[0])
    for name in available_solvers():
        if name in ("auto", "ilp"):
            continue
        if name == "dp" and by_blocks:
            skipped.append(f"dp skipped: {len(graph.nodes)} nodes of repeated blocks, which ilp solves block by block")
            continue
        attempt(name, get_solver(name))
    if len(graph.nodes) <= tuning.FLAT_MAX_NODES or by_blocks:
        warm = [p for p in plans if p.solver in WARM_SOLVERS]
        attempt("ilp", lambda g, b, c: ilp.solve_ilp(g, b, c, warm=warm))
    else:
        skipped.append(f"ilp skipped: {len(graph.nodes)} nodes > {tuning.FLAT_MAX_NODES} and no repeated blocks")
    if not plans:
        plans.append(least_of(errors, budget_bytes, "No solver fits"))
    best = min(plans, key=lambda p: (p.cost_seconds, p.peak_bytes))
    return best.but(note=f"auto chose {best.solver}: cheapest plan within budget. {best.note}".strip(),
                    skipped=tuple(skipped))
