"""Plans cut at FSDP unit edges, which the emitted module needs (a checkpoint cannot span two
units)."""

from __future__ import annotations

from ckptplan.build import solver_plan
from ckptplan.errors import InfeasibleBudgetError
from ckptplan.graph import ComputeGraph
from ckptplan.plan import Plan
from ckptplan.sharding import split_at_unit_edges
from ckptplan.simulation import simulate
from ckptplan.units import describe_bytes


def at_unit_edges(graph: ComputeGraph, plan: Plan, budget_bytes: int) -> Plan:
    """``plan`` with its regions cut at FSDP unit edges (``sharding.split_at_unit_edges``);
    raises ``InfeasibleBudgetError`` if the cut plan no longer fits."""
    regions = split_at_unit_edges(graph, plan.regions)
    if regions == plan.regions:
        return plan
    report = simulate(graph, regions)
    if report.peak_bytes > budget_bytes:
        cut = solver_plan(graph, regions, report.peak_bytes, plan.solver, report=report)
        raise InfeasibleBudgetError(
            f"The {plan.solver.name} plan no longer fits {describe_bytes(budget_bytes)} once its regions are cut at "
            f"the shard units' edges ({describe_bytes(report.peak_bytes)}); try --solver ilp, whose large-graph "
            "plans stay inside blocks, or raise the budget.",
            budget_bytes=budget_bytes,
            min_peak_bytes=report.peak_bytes,
            least_plan=cut,
        )
    note = f"{plan.solver.note}; regions cut at shard unit edges".lstrip("; ")
    return solver_plan(graph, regions, budget_bytes, plan.solver.model_copy(update={"note": note}), report=report)
